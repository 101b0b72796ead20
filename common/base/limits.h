/* common/base/limits.h: every limit that guards a size coming from a file, a peer
 * or a user, in one place (after sqlite's sqliteLimit.h). Each limit says why
 * it has the value it has. Code compares against these BEFORE allocating and
 * names the limit in its error message.
 *
 * Model limits follow docs/MODEL.md section 1.1 (the engine's
 * sanity limits); the others are sized for the real K3 with headroom.
 */
#ifndef K3_LIMITS_H
#define K3_LIMITS_H

/* ---- model configuration (docs/MODEL.md 1.1 limits) ---- */
#define K3_MAX_HIDDEN       65536     /* hidden <= 65536 */
#define K3_MAX_LAYERS       128       /* n_layers <= 128 (K3 has 93) */
#define K3_MAX_EXPERTS      4096      /* n_experts <= 4096 (K3 has 896) */
#define K3_MAX_TOPK         64        /* 1 <= topk <= 64 (K3 uses 16) */
#define K3_MAX_VOCAB        (1 << 22) /* vocab <= 2^22 (K3 has 163840) */
#define K3_MAX_CONV_K       8         /* conv_k <= 8 (K3 uses 4) */
#define K3_MAX_KDA_HD       512       /* kda head dim <= 512 (stack buffers) */
#define K3_MAX_HEAD_DIM     512  /* MLA qk_nope/qk_rope/v_head (K3: 128/64/128), stack buffers */
#define K3_MAX_KV_LORA      4096 /* kv_lora <= 4096 (stack buffers) */
#define K3_MAX_RES_ENTRIES  16   /* ceil(n_layers/res_bs)+1 <= 16 */
#define K3_MAX_HEADS        1024 /* 8x K3's 96: any sane MHA/KDA width */
#define K3_MAX_INTER        (1 << 20)   /* dense/moe intermediate (K3: 33792) */
#define K3_MAX_EOS          8           /* eos list has at most 8 ids */
#define K3_MAX_CONFIG_BYTES (64u << 20) /* docs/MODEL.md 1.1: config.json <= 64 MiB */

/* ---- safetensors (docs/TESTING.md 6.5) ---- */
#define K3_ST_MAX_HEADER   100000000ull /* upstream MAX_HEADER_SIZE */
#define K3_ST_MAX_RANK     8            /* h3.c's cap; K3 tensors are rank <= 3 */
#define K3_ST_MAX_TENSORS  1000000      /* K3 has ~82k experts x 6 + dense */
#define K3_ST_MAX_SHARDS   4096         /* K3 ships 96 shards */
#define K3_ST_MAX_NAME     512          /* longest K3 tensor name is < 100 */
#define K3_MAX_DIRS        16           /* --dirs: drives per worker */
#define K3_MAX_INDEX_BYTES (256u << 20) /* index.json; K3's is ~50 MB */

/* ---- expert striping (common/experts/placement.h) ---- */
#define K3_MAX_PLACEMENT_BYTES (64 << 20) /* placement JSON; K3's (93 x 896 ids) is ~0.4 MB */
#define K3_MAX_PATH            4096       /* a file path (PATH_MAX) */

/* ---- runtime ---- */
#define K3_MAX_CHUNK 512 /* docs/MODEL.md 5.2: K3_CHUNK 1..512 */
#define K3_MAX_CKPT                                                                                \
    64                                /* turn checkpoints per session: each holds every KDA        \
                                         state (~100 MB at K3 size), 64 is far past useful */
#define K3_MAX_CTX          (1 << 20) /* tokens per session: 1M (MLA cache 55 KB/token) */
#define K3_MAX_THREADS      256       /* per process */
#define K3_MAX_SESSIONS     4096      /* per worker state table */
#define K3_MAX_NGEN         (1 << 20) /* tokens to generate per request */
#define K3_MAX_LOAD_THREADS 16        /* docs/MODEL.md 5.4: K3_LOAD_THREADS 1..16 */

/* ---- tokenizer ---- */
#define K3_TOK_MAX_FILE        (64u << 20)  /* tiktoken.model for K3 is ~2.5 MB */
#define K3_TOK_MAX_TOKEN_BYTES 1024         /* longest K3 token is < 256 bytes */
#define K3_TOK_ADDED           256          /* K3: 256 control tokens above ranks */
#define K3_TOK_MAX_INPUT       (256u << 20) /* bytes of text per encode call */

/* ---- chat (docs/INTERFACES.md 2.3) ---- */
#define K3_CHAT_MAX_NAME      256  /* tool / argument names: the reference's 400 above 256 */
#define K3_CHAT_MAX_CALLS     64   /* tool calls per assistant message (reference) */
#define K3_CHAT_MAX_ARGS      64   /* arguments per tool call (reference) */
#define K3_CHAT_MAX_TAG_BYTES 2048 /* a generated tag: 256-byte name, escaped x6, + attrs */

/* ---- wire protocol (docs/PROTOCOL.md 3, docs/TESTING.md 6.4) ---- */
#define K3_PROTO_MAX_ENVELOPE 65536 /* envelope frame bytes */
#define K3_PROTO_MAX_DEPTH    8     /* msgpack nesting, well under 32 */
#define K3_PROTO_MAX_OBJECTS  4096  /* msgpack objects per envelope */
#define K3_PROTO_MAX_STR      4096  /* one string field */
#define K3_PROTO_MAX_FRAMES   8     /* frames per message */
#define K3_PROTO_MAX_KEYS     64    /* envelope map entries; v1's largest has 17 */
#define K3_PROTO_MAX_NAME     256   /* worker name / build id buffer (255 + NUL) */
#define K3_PROTO_MAX_EVICTED  64 /* sessions one FORWARD_DONE reports evicted (0-1 in practice) */
/* one tensor frame: blocks [16][512][65536] f32 would be 2 GiB; cap at 1 GiB */
#define K3_PROTO_MAX_FRAME_BYTES (1ull << 30)

/* ---- cluster transport (proto/link.h, worker/, coordinator/cluster.c) ---- */
#define K3_MAX_ALLOW_KEYS    1024  /* coordinator keys a worker admits; a cluster has a handful */
#define K3_MAX_KEYFILE_BYTES 65536 /* key / allow-list / worker-keys file; 1024 keys x ~60 B */
#define K3_MAX_WORKERS       128   /* stages: at most one per layer (K3_MAX_LAYERS) */
#define K3_MAX_ENDPOINT      256   /* one endpoint string (ipc paths are <= 107 bytes) */
#define K3_MAX_HOSTS         64    /* plan --hosts: hosts of a small cluster */
#define K3_MAX_HOSTS_FILE    (1u << 20) /* plan --hosts file: 64 hosts x 16 drives is ~100 KB */

/* ---- HTTP serving (coordinator/serve*.c, docs/SERVING.md) ---- */
#define K3_SERVE_MAX_BODY       (8u << 20) /* request body: 8 MiB holds ~2M tokens of text */
#define K3_SERVE_MAX_STOPS      4          /* stop strings per request (OpenAI's limit) */
#define K3_SERVE_MAX_STOP_BYTES 256  /* one stop string; longer ones are never tokens' worth */
#define K3_SERVE_MAX_MSGS       4096 /* messages per chat request; real chats hold < 1000 */
#define K3_SERVE_MAX_PARTS      1024 /* content parts per message */
#define K3_SERVE_MAX_QUEUE      1024 /* --max-queue: requests admitted at once */
#define K3_SERVE_MAX_CONNS                                                                         \
    4096 /* --max-conns: a thread each; 4096 x 8 MiB stacks is the                                 \
            most virtual memory a server should reserve for them */

/* --file / stdin prompt of the command line: ~60 M tokens of text */
#define K3_MAX_PROMPT_FILE_BYTES (256u << 20)

/* ---- repacked container (common/ckpt/container.h) ---- */
#define K3_REPACK_BLOCK                                                                            \
    (64u << 20) /* repack / verify read block: big enough for                                      \
                   GB/s sequential reads, small next to RAM */

/* ---- Vulkan expert tier (common/vk/, docs/VULKAN.md) ---- */
#define K3_VK_MAX_PAIRS                                                                            \
    65535                /* pairs per expert call: the workgroup count's guaranteed minimum        \
                          */
#define K3_VK_WAIT_S 120 /* one call's fence wait; lavapipe runs a K3 expert, n=4, in ~2 s */

#endif
