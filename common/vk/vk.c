/* common/vk/vk.c: see vk.h for what this module owns and its threads.
 *
 * Everything lives in host-visible coherent memory, mapped once: uploads
 * and activations are memcpy, and one command buffer runs both shader
 * stages (barrier between) per call, waited on with a fence. On a discrete
 * GPU without resizable BAR that memory may be system RAM read over PCIe;
 * a device-local staging path is future work (docs/VULKAN.md). */
#include "common/vk/vk.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/limits.h"
#include "common/base/log.h"

int k3_vk_built(void) {
#ifdef K3_HAVE_VK
    return 1;
#else
    return 0;
#endif
}

uint64_t k3_vk_expert_bytes(int inter, int latent) {
    const uint64_t mat = (uint64_t)inter * (uint64_t)latent;
    return 3 * (mat / 2 + mat / 32);
}

#ifndef K3_HAVE_VK

k3_status k3_vk_open(k3_vk **out, int device, double budget_gb, char *err, size_t errlen) {
    (void)device, (void)budget_gb;
    *out = NULL;
    return k3_errf(K3_ERR_STATE, err, errlen,
                   "the Vulkan expert tier is unavailable: this build had no glslc or no Vulkan "
                   "headers (install glslc and libvulkan-dev, `make deps`, and rebuild)");
}
void k3_vk_close(k3_vk **vk) { *vk = NULL; }
const char *k3_vk_device_name(const k3_vk *vk) { return (void)vk, "none"; }
int k3_vk_is_cpu(const k3_vk *vk) { return (void)vk, 0; }
int k3_vk_exact(const k3_vk *vk) { return (void)vk, 0; }
uint64_t k3_vk_budget_bytes(const k3_vk *vk) { return (void)vk, 0; }
uint64_t k3_vk_used_bytes(const k3_vk *vk) { return (void)vk, 0; }
k3_status k3_vk_expert_upload(k3_vk *vk, const k3_mxfp4 *w1, const k3_mxfp4 *w2, const k3_mxfp4 *w3,
                              k3_vk_expert **out, char *err, size_t errlen) {
    (void)vk, (void)w1, (void)w2, (void)w3;
    *out = NULL;
    return k3_errf(K3_ERR_STATE, err, errlen, "the Vulkan expert tier is unavailable");
}
void k3_vk_expert_free(k3_vk *vk, k3_vk_expert **e) { (void)vk, *e = NULL; }
k3_status k3_vk_expert_apply(k3_vk *vk, const k3_vk_expert *e, const float *z, int n, float b1,
                             float b2, float *y, char *err, size_t errlen) {
    (void)vk, (void)e, (void)z, (void)n, (void)b1, (void)b2, (void)y;
    return k3_errf(K3_ERR_STATE, err, errlen, "the Vulkan expert tier is unavailable");
}
k3_status k3_vk_experts_apply(k3_vk *vk, const k3_vk_expert *const *e, const int *n, int m,
                              const float *z, float b1, float b2, float *y, char *err,
                              size_t errlen) {
    (void)vk, (void)e, (void)n, (void)m, (void)z, (void)b1, (void)b2, (void)y;
    return k3_errf(K3_ERR_STATE, err, errlen, "the Vulkan expert tier is unavailable");
}

#else

#include <vulkan/vulkan.h>

#if defined(__SANITIZE_ADDRESS__)
#include <dlfcn.h>
#include <link.h>

/* AddressSanitizer builds only: every shared object mapped now (the Vulkan
 * loader's ICD and what it pulled in) is marked RTLD_NODELETE, so the
 * loader's dlclose at vkDestroyInstance leaves it mapped until exit. An ICD
 * that keeps heap memory behind a global would otherwise be reported by
 * LeakSanitizer as leaked from "<unknown module>" once unmapped, a report
 * no suppression can name: Debian's mesa-vulkan-drivers 22.3.6-1+deb12u2
 * (lavapipe) does so for 128 bytes, as `vulkaninfo --summary` run with
 * libasan preloaded shows without any k3shard code (docs/VULKAN.md). */
static int pin_one(struct dl_phdr_info *info, size_t size, void *ctx) {
    (void)size, (void)ctx;
    if (info->dlpi_name && info->dlpi_name[0]) {
        void *h = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
        if (h) dlclose(h); /* the reference dlopen took; NODELETE stays */
    }
    return 0;
}
static void pin_loaded_modules(void) { dl_iterate_phdr(pin_one, NULL); }
#else
static void pin_loaded_modules(void) {}
#endif

/* glslc -mfmt=num output of common/vk/shaders/expert.comp (Makefile): fused
 * steps in double (the CPU's bits; needs shaderFloat64), and the variant
 * with the device's own fma() for devices without float64. */
static const uint32_t k3_vk_expert_spv[] = {
#include "expert.spv.inc"
};
static const uint32_t k3_vk_expert_f32_spv[] = {
#include "expert_f32.spv.inc"
};

#define VK_WAIT_NS ((uint64_t)K3_VK_WAIT_S * 1000000000ull)

typedef struct vk_buf {
    VkBuffer buf;
    VkDeviceMemory mem;
    void *map;
    VkDeviceSize size;
} vk_buf;

struct k3_vk_expert {
    vk_buf w;
    int inter, latent;
};

struct k3_vk {
    VkInstance inst;
    VkPhysicalDevice phys;
    VkDevice dev;
    VkQueue queue;
    uint32_t qfam, memtype;
    VkDeviceSize max_range; /* maxStorageBufferRange */
    VkCommandPool cpool;
    VkCommandBuffer cmd;
    VkFence fence;
    VkDescriptorSetLayout dsl;
    VkPipelineLayout layout;
    VkShaderModule shader;
    VkPipeline pipe;
    VkDescriptorPool dpool;
    VkDescriptorSet *sets; /* [n_sets]: one per expert of a call */
    int n_sets;
    VkDeviceSize align; /* minStorageBufferOffsetAlignment */
    vk_buf x, a, y;     /* activations: z [n][L], SiTU [n][I], result [n][L] */
    uint64_t budget, used;
    pthread_mutex_t used_mu; /* used: uploads and frees may run beside an apply */
    int is_cpu;
    int fma64;  /* 1: the float64 FMA shader (the CPU's bits) */
    int broken; /* a call timed out: the command buffer may still run */
    char name[VK_MAX_PHYSICAL_DEVICE_NAME_SIZE];
};

typedef struct vk_push {
    uint32_t stage, n, inter, latent;
    float b1, b2;
} vk_push;

static k3_status vk_fail(VkResult r, const char *call, char *err, size_t errlen) {
    if (r == VK_ERROR_OUT_OF_DEVICE_MEMORY || r == VK_ERROR_OUT_OF_HOST_MEMORY)
        return k3_errf(K3_ERR_NOMEM, err, errlen, "vulkan: %s: out of %s memory (%d)", call,
                       r == VK_ERROR_OUT_OF_DEVICE_MEMORY ? "device" : "host", (int)r);
    return k3_errf(K3_ERR_INTERNAL, err, errlen, "vulkan: %s failed (VkResult %d)", call, (int)r);
}

#define VK_TRY(call, name)                                                                         \
    do {                                                                                           \
        VkResult r_ = (call);                                                                      \
        if (r_ != VK_SUCCESS) return vk_fail(r_, name, err, errlen);                               \
    } while (0)

static void buf_free(k3_vk *vk, vk_buf *b) {
    if (b->map) vkUnmapMemory(vk->dev, b->mem);
    if (b->buf) vkDestroyBuffer(vk->dev, b->buf, NULL);
    if (b->mem) vkFreeMemory(vk->dev, b->mem, NULL);
    memset(b, 0, sizeof *b);
}

static k3_status buf_alloc(k3_vk *vk, vk_buf *b, VkDeviceSize size, char *err, size_t errlen) {
    memset(b, 0, sizeof *b);
    VkBufferCreateInfo bi = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
                             .size = size,
                             .usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT,
                             .sharingMode = VK_SHARING_MODE_EXCLUSIVE};
    VK_TRY(vkCreateBuffer(vk->dev, &bi, NULL, &b->buf), "vkCreateBuffer");
    VkMemoryRequirements req;
    vkGetBufferMemoryRequirements(vk->dev, b->buf, &req);
    if (!(req.memoryTypeBits & (1u << vk->memtype))) {
        buf_free(vk, b);
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "vulkan: %s: storage buffers cannot use host-visible memory", vk->name);
    }
    VkMemoryAllocateInfo mi = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                               .allocationSize = req.size,
                               .memoryTypeIndex = vk->memtype};
    VkResult r = vkAllocateMemory(vk->dev, &mi, NULL, &b->mem);
    if (r == VK_SUCCESS) r = vkBindBufferMemory(vk->dev, b->buf, b->mem, 0);
    if (r == VK_SUCCESS) r = vkMapMemory(vk->dev, b->mem, 0, VK_WHOLE_SIZE, 0, &b->map);
    if (r != VK_SUCCESS) {
        buf_free(vk, b);
        return vk_fail(r, "vkAllocateMemory/vkMapMemory", err, errlen);
    }
    b->size = size;
    return K3_OK;
}

/* grows an activation buffer to at least size bytes */
static k3_status buf_need(k3_vk *vk, vk_buf *b, VkDeviceSize size, char *err, size_t errlen) {
    if (b->buf && b->size >= size) return K3_OK;
    buf_free(vk, b);
    return buf_alloc(vk, b, size + size / 4, err, errlen);
}

/* at least n descriptor sets (one per expert of a call); the pool is
 * remade larger when needed (no call is in flight then) */
static k3_status sets_need(k3_vk *vk, int n, char *err, size_t errlen) {
    if (n <= vk->n_sets) return K3_OK;
    int cap = vk->n_sets * 2 > n ? vk->n_sets * 2 : n;
    if (cap < 16) cap = 16;
    if (vk->dpool) vkDestroyDescriptorPool(vk->dev, vk->dpool, NULL);
    vk->dpool = VK_NULL_HANDLE;
    free(vk->sets);
    vk->sets = NULL;
    vk->n_sets = 0;
    VkDescriptorPoolSize ps = {.type = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                               .descriptorCount = 4 * (uint32_t)cap};
    VkDescriptorPoolCreateInfo dpi = {.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
                                      .maxSets = (uint32_t)cap,
                                      .poolSizeCount = 1,
                                      .pPoolSizes = &ps};
    VK_TRY(vkCreateDescriptorPool(vk->dev, &dpi, NULL, &vk->dpool), "vkCreateDescriptorPool");
    VkDescriptorSetLayout *lay = k3_xcalloc((size_t)cap, sizeof *lay);
    for (int i = 0; i < cap; i++) lay[i] = vk->dsl;
    vk->sets = k3_xcalloc((size_t)cap, sizeof *vk->sets);
    VkDescriptorSetAllocateInfo dai = {.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
                                       .descriptorPool = vk->dpool,
                                       .descriptorSetCount = (uint32_t)cap,
                                       .pSetLayouts = lay};
    VkResult r = vkAllocateDescriptorSets(vk->dev, &dai, vk->sets);
    free(lay);
    if (r != VK_SUCCESS) return vk_fail(r, "vkAllocateDescriptorSets", err, errlen);
    vk->n_sets = cap;
    return K3_OK;
}

static k3_status vk_setup(k3_vk *vk, int device, double budget_gb, char *err, size_t errlen) {
    VkApplicationInfo app = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO,
                             .pApplicationName = "k3shard",
                             .apiVersion = VK_API_VERSION_1_1};
    VkInstanceCreateInfo ii = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                               .pApplicationInfo = &app};
    VkResult r = vkCreateInstance(&ii, NULL, &vk->inst);
    if (r == VK_ERROR_INCOMPATIBLE_DRIVER || r == VK_ERROR_INITIALIZATION_FAILED)
        return k3_errf(K3_ERR_MISSING, err, errlen,
                       "no Vulkan device: no Vulkan driver is installed (VkResult %d; on Debian, "
                       "mesa-vulkan-drivers has lavapipe)",
                       (int)r);
    if (r != VK_SUCCESS) return vk_fail(r, "vkCreateInstance", err, errlen);
    uint32_t nd = 0;
    VK_TRY(vkEnumeratePhysicalDevices(vk->inst, &nd, NULL), "vkEnumeratePhysicalDevices");
    if (nd == 0) return k3_errf(K3_ERR_MISSING, err, errlen, "no Vulkan device found");
    if (device < 0 || (uint32_t)device >= nd)
        return k3_errf(K3_ERR_MISSING, err, errlen,
                       "no Vulkan device %d: there %s %u (indices 0..%u)", device,
                       nd == 1 ? "is" : "are", nd, nd - 1);
    VkPhysicalDevice devs[64];
    uint32_t nget = nd < 64 ? nd : 64;
    r = vkEnumeratePhysicalDevices(vk->inst, &nget, devs);
    if (r != VK_SUCCESS && r != VK_INCOMPLETE)
        return vk_fail(r, "vkEnumeratePhysicalDevices", err, errlen);
    if ((uint32_t)device >= nget)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "Vulkan device %d: only the first %u are used",
                       device, nget);
    vk->phys = devs[device];
    VkPhysicalDeviceProperties props;
    vkGetPhysicalDeviceProperties(vk->phys, &props);
    snprintf(vk->name, sizeof vk->name, "%s", props.deviceName);
    vk->is_cpu = props.deviceType == VK_PHYSICAL_DEVICE_TYPE_CPU;
    vk->max_range = props.limits.maxStorageBufferRange;
    vk->align = props.limits.minStorageBufferOffsetAlignment
                    ? props.limits.minStorageBufferOffsetAlignment
                    : 1;

    uint32_t nq = 0;
    vkGetPhysicalDeviceQueueFamilyProperties(vk->phys, &nq, NULL);
    VkQueueFamilyProperties qf[32];
    nq = nq < 32 ? nq : 32;
    vkGetPhysicalDeviceQueueFamilyProperties(vk->phys, &nq, qf);
    vk->qfam = UINT32_MAX;
    for (uint32_t i = 0; i < nq && vk->qfam == UINT32_MAX; i++)
        if (qf[i].queueFlags & VK_QUEUE_COMPUTE_BIT) vk->qfam = i;
    if (vk->qfam == UINT32_MAX)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "Vulkan device %d (%s) has no compute queue, which the expert tier needs",
                       device, vk->name);
    VkPhysicalDeviceMemoryProperties mp;
    vkGetPhysicalDeviceMemoryProperties(vk->phys, &mp);
    const VkMemoryPropertyFlags want =
        VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
    vk->memtype = UINT32_MAX;
    VkDeviceSize heap = 0;
    for (uint32_t i = 0; i < mp.memoryTypeCount; i++) {
        if ((mp.memoryTypes[i].propertyFlags & want) != want) continue;
        VkDeviceSize hs = mp.memoryHeaps[mp.memoryTypes[i].heapIndex].size;
        /* prefer device-local host-visible memory (resizable BAR, unified) */
        int local = !!(mp.memoryTypes[i].propertyFlags & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);
        int best_local = vk->memtype != UINT32_MAX && (mp.memoryTypes[vk->memtype].propertyFlags &
                                                       VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);
        if (vk->memtype == UINT32_MAX || (local && !best_local) ||
            (local == best_local && hs > heap)) {
            vk->memtype = i;
            heap = hs;
        }
    }
    if (vk->memtype == UINT32_MAX)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "Vulkan device %d (%s) has no host-visible coherent memory, which the "
                       "expert tier needs",
                       device, vk->name);
    vk->budget = budget_gb > 0 ? (uint64_t)(budget_gb * 1e9) : (uint64_t)heap;
    if (vk->budget > heap) {
        k3_log(K3_LOG_WARN, "vulkan: budget %.2f GB is above %s's heap of %.2f GB; using the heap",
               budget_gb, vk->name, (double)heap / 1e9);
        vk->budget = heap;
    }

    VkPhysicalDeviceFeatures have, feat = {0};
    vkGetPhysicalDeviceFeatures(vk->phys, &have);
    vk->fma64 = have.shaderFloat64 == VK_TRUE;
    const char *fma = getenv("K3_VK_FMA"); /* "native": the fma() shader (tests, comparisons) */
    if (fma && strcmp(fma, "native") == 0) vk->fma64 = 0;
    feat.shaderFloat64 = have.shaderFloat64;
    if (!vk->fma64 && !(fma && strcmp(fma, "native") == 0))
        k3_log(K3_LOG_WARN,
               "vulkan: %s has no float64 in shaders: experts use the device's fma(), within "
               "~1e-7 of the CPU but not the same bits (docs/VULKAN.md)",
               vk->name);
    const float prio = 1.0f;
    VkDeviceQueueCreateInfo qi = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                                  .queueFamilyIndex = vk->qfam,
                                  .queueCount = 1,
                                  .pQueuePriorities = &prio};
    VkDeviceCreateInfo di = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
                             .queueCreateInfoCount = 1,
                             .pQueueCreateInfos = &qi,
                             .pEnabledFeatures = &feat};
    VK_TRY(vkCreateDevice(vk->phys, &di, NULL, &vk->dev), "vkCreateDevice");
    vkGetDeviceQueue(vk->dev, vk->qfam, 0, &vk->queue);

    VkCommandPoolCreateInfo ci = {.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
                                  .flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
                                  .queueFamilyIndex = vk->qfam};
    VK_TRY(vkCreateCommandPool(vk->dev, &ci, NULL, &vk->cpool), "vkCreateCommandPool");
    VkCommandBufferAllocateInfo cai = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                                       .commandPool = vk->cpool,
                                       .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                                       .commandBufferCount = 1};
    VK_TRY(vkAllocateCommandBuffers(vk->dev, &cai, &vk->cmd), "vkAllocateCommandBuffers");
    VkFenceCreateInfo fi = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
    VK_TRY(vkCreateFence(vk->dev, &fi, NULL, &vk->fence), "vkCreateFence");

    VkDescriptorSetLayoutBinding bind[4];
    for (int i = 0; i < 4; i++)
        bind[i] =
            (VkDescriptorSetLayoutBinding){.binding = (uint32_t)i,
                                           .descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                           .descriptorCount = 1,
                                           .stageFlags = VK_SHADER_STAGE_COMPUTE_BIT};
    VkDescriptorSetLayoutCreateInfo dli = {.sType =
                                               VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
                                           .bindingCount = 4,
                                           .pBindings = bind};
    VK_TRY(vkCreateDescriptorSetLayout(vk->dev, &dli, NULL, &vk->dsl),
           "vkCreateDescriptorSetLayout");
    VkPushConstantRange pcr = {.stageFlags = VK_SHADER_STAGE_COMPUTE_BIT, .size = sizeof(vk_push)};
    VkPipelineLayoutCreateInfo pli = {.sType = VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
                                      .setLayoutCount = 1,
                                      .pSetLayouts = &vk->dsl,
                                      .pushConstantRangeCount = 1,
                                      .pPushConstantRanges = &pcr};
    VK_TRY(vkCreatePipelineLayout(vk->dev, &pli, NULL, &vk->layout), "vkCreatePipelineLayout");
    VkShaderModuleCreateInfo si = {.sType = VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
                                   .codeSize = vk->fma64 ? sizeof k3_vk_expert_spv
                                                         : sizeof k3_vk_expert_f32_spv,
                                   .pCode = vk->fma64 ? k3_vk_expert_spv : k3_vk_expert_f32_spv};
    VK_TRY(vkCreateShaderModule(vk->dev, &si, NULL, &vk->shader), "vkCreateShaderModule");
    VkComputePipelineCreateInfo cpi = {
        .sType = VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
        .stage = {.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                  .stage = VK_SHADER_STAGE_COMPUTE_BIT,
                  .module = vk->shader,
                  .pName = "main"},
        .layout = vk->layout};
    VK_TRY(vkCreateComputePipelines(vk->dev, VK_NULL_HANDLE, 1, &cpi, NULL, &vk->pipe),
           "vkCreateComputePipelines");
    return sets_need(vk, 1, err, errlen);
}

k3_status k3_vk_open(k3_vk **out, int device, double budget_gb, char *err, size_t errlen) {
    *out = NULL;
    k3_vk *vk = k3_xcalloc(1, sizeof *vk);
    pthread_mutex_init(&vk->used_mu, NULL);
    k3_status st = vk_setup(vk, device, budget_gb, err, errlen);
    if (st != K3_OK) {
        k3_vk_close(&vk);
        return st;
    }
    *out = vk;
    return K3_OK;
}

void k3_vk_close(k3_vk **pvk) {
    k3_vk *vk = *pvk;
    if (!vk) return;
    if (vk->dev) {
        if (!vk->broken) vkDeviceWaitIdle(vk->dev);
        buf_free(vk, &vk->x);
        buf_free(vk, &vk->a);
        buf_free(vk, &vk->y);
        if (vk->dpool) vkDestroyDescriptorPool(vk->dev, vk->dpool, NULL);
        if (vk->pipe) vkDestroyPipeline(vk->dev, vk->pipe, NULL);
        if (vk->shader) vkDestroyShaderModule(vk->dev, vk->shader, NULL);
        if (vk->layout) vkDestroyPipelineLayout(vk->dev, vk->layout, NULL);
        if (vk->dsl) vkDestroyDescriptorSetLayout(vk->dev, vk->dsl, NULL);
        if (vk->fence) vkDestroyFence(vk->dev, vk->fence, NULL);
        if (vk->cpool) vkDestroyCommandPool(vk->dev, vk->cpool, NULL);
        vkDestroyDevice(vk->dev, NULL);
    }
    if (vk->inst) {
        pin_loaded_modules(); /* sanitizer builds: see above */
        vkDestroyInstance(vk->inst, NULL);
    }
    free(vk->sets);
    pthread_mutex_destroy(&vk->used_mu);
    free(vk);
    *pvk = NULL;
}

const char *k3_vk_device_name(const k3_vk *vk) { return vk->name; }
int k3_vk_is_cpu(const k3_vk *vk) { return vk->is_cpu; }
int k3_vk_exact(const k3_vk *vk) { return vk->fma64; }
uint64_t k3_vk_budget_bytes(const k3_vk *vk) { return vk->budget; }
uint64_t k3_vk_used_bytes(const k3_vk *vk) {
    pthread_mutex_lock((pthread_mutex_t *)&vk->used_mu);
    uint64_t u = vk->used;
    pthread_mutex_unlock((pthread_mutex_t *)&vk->used_mu);
    return u;
}

static int shape_ok(const k3_mxfp4 *m, int rows, int cols) {
    return m->rows == rows && m->cols == cols && m->packed && m->scale;
}

k3_status k3_vk_expert_upload(k3_vk *vk, const k3_mxfp4 *w1, const k3_mxfp4 *w2, const k3_mxfp4 *w3,
                              k3_vk_expert **out, char *err, size_t errlen) {
    *out = NULL;
    const int I = w1->rows, L = w1->cols;
    if (I <= 0 || L <= 0 || I % 32 || L % 32 || !shape_ok(w1, I, L) || !shape_ok(w2, L, I) ||
        !shape_ok(w3, I, L))
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "vulkan upload: expert shapes w1 %dx%d, w2 %dx%d, w3 %dx%d are not "
                       "[I][L], [L][I], [I][L] with I, L multiples of 32",
                       w1->rows, w1->cols, w2->rows, w2->cols, w3->rows, w3->cols);
    const uint64_t bytes = k3_vk_expert_bytes(I, L);
    if (bytes > vk->max_range)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "vulkan upload: an expert of %llu bytes passes %s's storage buffer "
                       "limit of %llu bytes",
                       (unsigned long long)bytes, vk->name, (unsigned long long)vk->max_range);
    pthread_mutex_lock(&vk->used_mu); /* reserve the bytes first */
    uint64_t used = vk->used;
    if (used + bytes <= vk->budget) vk->used += bytes;
    pthread_mutex_unlock(&vk->used_mu);
    if (used + bytes > vk->budget)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "vulkan upload: %llu more bytes would pass the tier budget of %llu bytes "
                       "(%llu in use)",
                       (unsigned long long)bytes, (unsigned long long)vk->budget,
                       (unsigned long long)used);
    k3_vk_expert *e = k3_xcalloc(1, sizeof *e);
    k3_status st = buf_alloc(vk, &e->w, bytes, err, errlen);
    if (st != K3_OK) {
        free(e);
        pthread_mutex_lock(&vk->used_mu);
        vk->used -= bytes;
        pthread_mutex_unlock(&vk->used_mu);
        return st;
    }
    e->inter = I;
    e->latent = L;
    const size_t mat = (size_t)I * L;
    uint8_t *p = e->w.map;
    const k3_mxfp4 *m[3] = {w1, w2, w3};
    for (int i = 0; i < 3; i++) { /* slot layout: w1p w1s w2p w2s w3p w3s */
        memcpy(p, m[i]->packed, mat / 2);
        memcpy(p + mat / 2, m[i]->scale, mat / 32);
        p += mat / 2 + mat / 32;
    }
    *out = e;
    return K3_OK;
}

void k3_vk_expert_free(k3_vk *vk, k3_vk_expert **pe) {
    k3_vk_expert *e = *pe;
    if (!e) return;
    buf_free(vk, &e->w);
    pthread_mutex_lock(&vk->used_mu);
    vk->used -= k3_vk_expert_bytes(e->inter, e->latent);
    pthread_mutex_unlock(&vk->used_mu);
    free(e);
    *pe = NULL;
}

k3_status k3_vk_expert_apply(k3_vk *vk, const k3_vk_expert *e, const float *z, int n, float b1,
                             float b2, float *y, char *err, size_t errlen) {
    return k3_vk_experts_apply(vk, &e, &n, 1, z, b1, b2, y, err, errlen);
}

static VkDeviceSize round_up(VkDeviceSize x, VkDeviceSize a) { return (x + a - 1) / a * a; }

k3_status k3_vk_experts_apply(k3_vk *vk, const k3_vk_expert *const *e, const int *n, int m,
                              const float *z, float b1, float b2, float *y, char *err,
                              size_t errlen) {
    if (vk->broken)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "vulkan: %s timed out earlier; the tier is off for this process", vk->name);
    if (m <= 0) return K3_OK;
    const int I = e[0]->inter, L = e[0]->latent;
    /* each expert's rows get their own aligned segment of x, a and y */
    VkDeviceSize *off = k3_xcalloc((size_t)m * 2, sizeof *off); /* [m] x/y, [m] a */
    VkDeviceSize xt = 0, at = 0;
    int live = 0;
    for (int i = 0; i < m; i++) {
        if (e[i]->inter != I || e[i]->latent != L || n[i] < 0) {
            free(off);
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "vulkan: expert %d of a call is %dx%d with %d pairs, the first %dx%d", i,
                           e[i]->inter, e[i]->latent, n[i], I, L);
        }
        const VkDeviceSize xb = (VkDeviceSize)n[i] * L * sizeof(float);
        const VkDeviceSize ab = (VkDeviceSize)n[i] * I * sizeof(float);
        if (xb > vk->max_range || ab > vk->max_range || n[i] > K3_VK_MAX_PAIRS) {
            free(off);
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "vulkan: %d pairs of %d and %d floats pass %s's limits (%llu bytes "
                           "per buffer, %d pairs)",
                           n[i], L, I, vk->name, (unsigned long long)vk->max_range,
                           K3_VK_MAX_PAIRS);
        }
        off[i] = xt;
        off[m + i] = at;
        xt += round_up(xb, vk->align);
        at += round_up(ab, vk->align);
        live += n[i] > 0;
    }
    k3_status st = K3_OK;
    if (live == 0) goto done;
    if ((st = buf_need(vk, &vk->x, xt, err, errlen)) != K3_OK ||
        (st = buf_need(vk, &vk->a, at, err, errlen)) != K3_OK ||
        (st = buf_need(vk, &vk->y, xt, err, errlen)) != K3_OK ||
        (st = sets_need(vk, m, err, errlen)) != K3_OK)
        goto done;
    size_t row = 0; /* rows of z / y so far */
    for (int i = 0; i < m; i++) {
        memcpy((char *)vk->x.map + off[i], z + row * L, sizeof(float) * (size_t)n[i] * L);
        row += (size_t)n[i];
        if (n[i] == 0) continue;
        const VkDeviceSize xb = (VkDeviceSize)n[i] * L * sizeof(float);
        const VkDeviceSize ab = (VkDeviceSize)n[i] * I * sizeof(float);
        VkDescriptorBufferInfo bi[4] = {{e[i]->w.buf, 0, VK_WHOLE_SIZE},
                                        {vk->x.buf, off[i], xb},
                                        {vk->a.buf, off[m + i], ab},
                                        {vk->y.buf, off[i], xb}};
        VkWriteDescriptorSet wr[4];
        for (int k = 0; k < 4; k++)
            wr[k] = (VkWriteDescriptorSet){.sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET,
                                           .dstSet = vk->sets[i],
                                           .dstBinding = (uint32_t)k,
                                           .descriptorCount = 1,
                                           .descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                           .pBufferInfo = &bi[k]};
        vkUpdateDescriptorSets(vk->dev, 4, wr, 0, NULL);
    }

    VkResult r = vkResetCommandBuffer(vk->cmd, 0);
    VkCommandBufferBeginInfo cbi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                                    .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
    if (r == VK_SUCCESS) r = vkBeginCommandBuffer(vk->cmd, &cbi);
    if (r != VK_SUCCESS) {
        st = vk_fail(r, "vkBeginCommandBuffer", err, errlen);
        goto done;
    }
    vkCmdBindPipeline(vk->cmd, VK_PIPELINE_BIND_POINT_COMPUTE, vk->pipe);
    /* stage 0 of every expert, one barrier, stage 1 of every expert */
    for (int stage = 0; stage < 2; stage++) {
        for (int i = 0; i < m; i++) {
            if (n[i] == 0) continue;
            vkCmdBindDescriptorSets(vk->cmd, VK_PIPELINE_BIND_POINT_COMPUTE, vk->layout, 0, 1,
                                    &vk->sets[i], 0, NULL);
            vk_push pc = {(uint32_t)stage, (uint32_t)n[i], (uint32_t)I, (uint32_t)L, b1, b2};
            vkCmdPushConstants(vk->cmd, vk->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, sizeof pc, &pc);
            vkCmdDispatch(vk->cmd, (uint32_t)((stage ? L : I) + 63) / 64, (uint32_t)n[i], 1);
        }
        VkMemoryBarrier mb = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                              .srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT,
                              .dstAccessMask =
                                  stage ? VK_ACCESS_HOST_READ_BIT : VK_ACCESS_SHADER_READ_BIT};
        vkCmdPipelineBarrier(vk->cmd, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                             stage ? VK_PIPELINE_STAGE_HOST_BIT
                                   : VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                             0, 1, &mb, 0, NULL, 0, NULL);
    }
    r = vkEndCommandBuffer(vk->cmd);
    if (r == VK_SUCCESS) r = vkResetFences(vk->dev, 1, &vk->fence);
    VkSubmitInfo sub = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO,
                        .commandBufferCount = 1,
                        .pCommandBuffers = &vk->cmd};
    if (r == VK_SUCCESS) r = vkQueueSubmit(vk->queue, 1, &sub, vk->fence);
    if (r != VK_SUCCESS) {
        st = vk_fail(r, "vkQueueSubmit", err, errlen);
        goto done;
    }
    r = vkWaitForFences(vk->dev, 1, &vk->fence, VK_TRUE, VK_WAIT_NS);
    if (r == VK_TIMEOUT) {
        vk->broken = 1;
        st = k3_errf(K3_ERR_TIMEOUT, err, errlen,
                     "vulkan: %s did not finish %d experts (%zu pairs) in %llu s", vk->name, m, row,
                     VK_WAIT_NS / 1000000000ull);
        goto done;
    }
    if (r != VK_SUCCESS) {
        st = vk_fail(r, "vkWaitForFences", err, errlen);
        goto done;
    }
    row = 0;
    for (int i = 0; i < m; i++) {
        memcpy(y + row * L, (char *)vk->y.map + off[i], sizeof(float) * (size_t)n[i] * L);
        row += (size_t)n[i];
    }
done:
    free(off);
    return st;
}

#endif
