/* proto/link.c: socket options, endpoint policy, CURVE key files, the ZAP
 * handler, the --worker-keys file and the numeric settings HELLO compares
 * (link.h).
 *
 * Key files are small text files, one "name = value" line per key:
 *   <prefix>.key   public = <40 Z85>, secret = <40 Z85>   mode 0600
 *   <prefix>.pub   public = <40 Z85>
 *   worker keys    ENDPOINT <40 Z85> | * <40 Z85>      (the coordinator's)
 * An allow-list holds public keys, bare or as "public = ..." lines, so a
 * .pub file (or several concatenated) is an allow-list. Lines of a secret
 * file are never quoted in an error message: one of them is the key.
 */
#include "proto/link.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kernels/kernels.h"
#include "common/base/limits.h"
#include "common/base/log.h"

/* Hidden by the stable zmq.h of libzmq 4.3.4 (draft section), but its
 * setsockopt handler is compiled in: without it a CURVE server with no ZAP
 * answer accepts every client (docs/TESTING.md 6.3, measured). */
#ifndef ZMQ_ZAP_ENFORCE_DOMAIN
#define ZMQ_ZAP_ENFORCE_DOMAIN 93
#endif

#define K3_ZAP_DOMAIN   "k3shard"
#define K3_ZAP_ENDPOINT "inproc://zeromq.zap.01"

static k3_status zfail(const char *what, char *err, size_t errlen) {
    return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", what, zmq_strerror(zmq_errno()));
}

static k3_status set_int(void *s, int opt, int v, const char *name, char *err, size_t errlen) {
    if (zmq_setsockopt(s, opt, &v, sizeof v) != 0) {
        char what[64];
        snprintf(what, sizeof what, "setsockopt %s=%d", name, v);
        return zfail(what, err, errlen);
    }
    return K3_OK;
}

k3_status k3_link_sockopts_apply(void *sock, const k3_link_sockopts *o, char *err, size_t errlen) {
    /* TTL travels in deciseconds and must stay < 60 s (libzmq #4226). */
    if (o->hb_ms != 0 && (o->hb_ms < K3_LINK_HB_MS_MIN || o->hb_ms > K3_LINK_HB_MS_MAX))
        return k3_errf(K3_ERR_ARG, err, errlen, "heartbeat interval %d ms outside [%d, %d]",
                       o->hb_ms, K3_LINK_HB_MS_MIN, K3_LINK_HB_MS_MAX);
    if (o->linger_ms < 0 || o->linger_ms > 10000)
        return k3_errf(K3_ERR_ARG, err, errlen, "linger %d ms outside [0, 10000]", o->linger_ms);
    k3_status st = set_int(sock, ZMQ_LINGER, o->linger_ms, "ZMQ_LINGER", err, errlen);
    if (!st && o->hb_ms) {
        int ttl = o->hb_ms * K3_LINK_LIVENESS;
        st = set_int(sock, ZMQ_HEARTBEAT_IVL, o->hb_ms, "ZMQ_HEARTBEAT_IVL", err, errlen);
        if (!st)
            st = set_int(sock, ZMQ_HEARTBEAT_TIMEOUT, ttl, "ZMQ_HEARTBEAT_TIMEOUT", err, errlen);
        if (!st) st = set_int(sock, ZMQ_HEARTBEAT_TTL, ttl, "ZMQ_HEARTBEAT_TTL", err, errlen);
    }
    if (!st && o->handshake_ms > 0)
        st = set_int(sock, ZMQ_HANDSHAKE_IVL, o->handshake_ms, "ZMQ_HANDSHAKE_IVL", err, errlen);
    if (!st) st = set_int(sock, ZMQ_RECONNECT_IVL, 100, "ZMQ_RECONNECT_IVL", err, errlen);
    if (!st) st = set_int(sock, ZMQ_RECONNECT_IVL_MAX, 2000, "ZMQ_RECONNECT_IVL_MAX", err, errlen);
    if (!st) st = proto_socket_limit(sock, err, errlen);
    return st;
}

/* ---- endpoints ---- */

/* Loopback = traffic that cannot leave this host: localhost, ::1 and all of
 * 127.0.0.0/8. Host names other than "localhost" are not resolved here, so
 * they count as network (the safe side: CURVE or --insecure needed). */
static int is_loopback_host(const char *h, size_t n) {
    if (n == 9 && !memcmp(h, "localhost", 9)) return 1;
    if ((n == 3 && !memcmp(h, "::1", 3)) || (n == 5 && !memcmp(h, "[::1]", 5))) return 1;
    /* 127.0.0.0/8: a dotted quad whose first octet is 127 */
    if (n < 7 || memcmp(h, "127.", 4) != 0) return 0;
    int dots = 0;
    for (size_t i = 0; i < n; i++) {
        if (h[i] == '.')
            dots++;
        else if (h[i] < '0' || h[i] > '9')
            return 0;
    }
    return dots == 3;
}

/* Syntax checks happen here, before libzmq sees the string, so that a typo
 * is an error naming the endpoint instead of a connect that retries forever. */
k3_link_ep_kind k3_link_endpoint_kind(const char *ep, char *err, size_t errlen) {
    if (!ep || !*ep) {
        k3_errf(K3_ERR_ARG, err, errlen, "empty endpoint");
        return K3_EP_INVALID;
    }
    size_t len = strlen(ep);
    if (len >= K3_MAX_ENDPOINT) {
        k3_errf(K3_ERR_LIMIT, err, errlen, "endpoint of %zu bytes > limit %d (K3_MAX_ENDPOINT)",
                len, K3_MAX_ENDPOINT - 1);
        return K3_EP_INVALID;
    }
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)ep[i] < 0x21 || (unsigned char)ep[i] == 0x7f) {
            k3_errf(K3_ERR_ARG, err, errlen, "endpoint '%s': control character or space", ep);
            return K3_EP_INVALID;
        }
    if (!strncmp(ep, "ipc://", 6)) {
        /* sun_path holds 108 bytes including the NUL */
        size_t n = len - 6;
        if (n == 0 || n > 107) {
            k3_errf(K3_ERR_ARG, err, errlen,
                    "endpoint '%s': ipc path of %zu bytes, expected 1..107", ep, n);
            return K3_EP_INVALID;
        }
        return K3_EP_IPC;
    }
    if (!strncmp(ep, "inproc://", 9)) {
        if (len == 9) {
            k3_errf(K3_ERR_ARG, err, errlen, "endpoint '%s': empty inproc name", ep);
            return K3_EP_INVALID;
        }
        return K3_EP_INPROC;
    }
    if (strncmp(ep, "tcp://", 6) != 0) {
        k3_errf(K3_ERR_ARG, err, errlen,
                "endpoint '%s': unknown transport (expected ipc://, tcp:// or inproc://)", ep);
        return K3_EP_INVALID;
    }
    const char *host = ep + 6;
    const char *colon = strrchr(host, ':');
    if (strchr(host, ';')) { /* libzmq's "source;destination" form: not supported */
        k3_errf(K3_ERR_ARG, err, errlen, "endpoint '%s': source addresses (';') are not supported",
                ep);
        return K3_EP_INVALID;
    }
    if (!colon || colon == host) {
        k3_errf(K3_ERR_ARG, err, errlen, "endpoint '%s': expected tcp://HOST:PORT", ep);
        return K3_EP_INVALID;
    }
    const char *port = colon + 1;
    if (strcmp(port, "*") != 0) {
        long v = 0;
        size_t nd = 0;
        for (; port[nd]; nd++) {
            if (port[nd] < '0' || port[nd] > '9' || nd >= 5) {
                v = -1;
                break;
            }
            v = v * 10 + (port[nd] - '0');
        }
        if (nd == 0 || v < 0 || v > 65535) {
            k3_errf(K3_ERR_ARG, err, errlen, "endpoint '%s': port '%s' is not 0..65535 or *", ep,
                    port);
            return K3_EP_INVALID;
        }
    }
    return is_loopback_host(host, (size_t)(colon - host)) ? K3_EP_TCP_LOOPBACK : K3_EP_TCP_NET;
}

k3_status k3_link_endpoint_policy(const char *ep, int have_curve, int insecure, const char *who,
                                  char *err, size_t errlen) {
    k3_link_ep_kind k = k3_link_endpoint_kind(ep, err, errlen);
    if (k == K3_EP_INVALID) {
        k3_err_prefix(err, errlen, "%s", who);
        return K3_ERR_ARG;
    }
    if (k == K3_EP_TCP_NET && !have_curve && !insecure)
        return k3_errf(K3_ERR_AUTH, err, errlen,
                       "%s %s: a tcp endpoint off loopback needs CURVE keys (k3-coordinator "
                       "keygen; see --curve-secret) or --insecure",
                       who, ep);
    return K3_OK;
}

/* ---- small files ---- */

/* Reads a whole regular file of at most max bytes, NUL-terminated. With
 * `secret`, refuses a file that group or others may read or write (C6):
 * checked on the open descriptor, so a file swapped after a stat cannot
 * slip through. */
static k3_status read_small(const char *path, size_t max, char **out, size_t *len, int secret,
                            char *err, size_t errlen) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", path, strerror(errno));
    struct stat sb;
    k3_status st = K3_OK;
    if (fstat(fd, &sb) != 0) {
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: fstat: %s", path, strerror(errno));
    } else if (!S_ISREG(sb.st_mode)) {
        st = k3_errf(K3_ERR_ARG, err, errlen, "%s: not a regular file", path);
    } else if (secret && (sb.st_mode & 077)) {
        st = k3_errf(K3_ERR_AUTH, err, errlen,
                     "%s: secret key file has mode %04o, must not be accessible by group or "
                     "others (chmod 600 %s)",
                     path, (unsigned)(sb.st_mode & 07777), path);
    } else if ((uint64_t)sb.st_size > max) {
        st = k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %lld bytes > limit %zu", path,
                     (long long)sb.st_size, max);
    }
    if (st) {
        close(fd);
        return st;
    }
    size_t n = (size_t)sb.st_size;
    char *buf = malloc(n + 1);
    if (!buf) {
        close(fd);
        return k3_errf(K3_ERR_NOMEM, err, errlen, "%s: cannot allocate %zu bytes", path, n + 1);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            st = k3_errf(K3_ERR_IO, err, errlen, "%s: read: %s", path,
                         r < 0 ? strerror(errno) : "file shrank while reading");
            break;
        }
        got += (size_t)r;
    }
    close(fd);
    if (st) {
        free(buf);
        return st;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return K3_OK;
}

/* ---- CURVE keys ---- */

static int z85_char(char c) {
    static const char z85[] =
        "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
    return c && strchr(z85, c) != NULL;
}

/* Trims spaces; returns the start and sets *n. */
static const char *trim(const char *s, size_t len, size_t *n) {
    while (len && (*s == ' ' || *s == '\t' || *s == '\r')) s++, len--;
    while (len && (s[len - 1] == ' ' || s[len - 1] == '\t' || s[len - 1] == '\r')) len--;
    *n = len;
    return s;
}

/* "name = value" or a bare value: copies a 40-char Z85 key into out. */
static k3_status parse_key_line(const char *line, size_t len, const char *want_name,
                                char out[K3_Z85_KEY_LEN + 1], char *err, size_t errlen) {
    size_t n;
    const char *s = trim(line, len, &n);
    const char *eq = memchr(s, '=', n);
    /* '=' is also a Z85 character, so "name =" is recognised by its name */
    size_t nl = strlen(want_name);
    if (eq && n > nl && !memcmp(s, want_name, nl) && (s[nl] == ' ' || s[nl] == '=')) {
        s = trim(eq + 1, n - (size_t)(eq + 1 - s), &n);
    }
    if (n != K3_Z85_KEY_LEN)
        return k3_errf(K3_ERR_FORMAT, err, errlen, "key of %zu characters, expected %d (Z85)", n,
                       K3_Z85_KEY_LEN);
    for (size_t i = 0; i < n; i++)
        if (!z85_char(s[i]))
            return k3_errf(K3_ERR_FORMAT, err, errlen, "key character %zu is not Z85", i + 1);
    memcpy(out, s, n);
    out[n] = 0;
    return K3_OK;
}

k3_status k3_link_public_parse(const char *text, char out_z85[K3_Z85_KEY_LEN + 1], char *err,
                               size_t errlen) {
    return parse_key_line(text, strlen(text), "public", out_z85, err, errlen);
}

static k3_status write_file(const char *path, const char *text, mode_t mode, char *err,
                            size_t errlen) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0)
        return k3_errf(K3_ERR_IO, err, errlen, "%s: %s%s", path, strerror(errno),
                       errno == EEXIST ? " (refusing to overwrite a key file)" : "");
    /* the umask may have widened nothing but could narrow .pub: set it */
    k3_status st = K3_OK;
    if (fchmod(fd, mode) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: chmod: %s", path, strerror(errno));
    size_t n = strlen(text), off = 0;
    while (!st && off < n) {
        ssize_t w = write(fd, text + off, n - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
            st = k3_errf(K3_ERR_IO, err, errlen, "%s: write: %s", path, strerror(errno));
        else
            off += (size_t)w;
    }
    if (close(fd) != 0 && !st)
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: close: %s", path, strerror(errno));
    return st;
}

k3_status k3_link_keygen(const char *prefix, k3_curve_keypair *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (!prefix || !*prefix || strlen(prefix) > 4000)
        return k3_errf(K3_ERR_ARG, err, errlen, "keygen: output prefix must be 1..4000 bytes");
    if (!zmq_has("curve"))
        return k3_errf(K3_ERR_STATE, err, errlen, "keygen: this libzmq was built without CURVE");
    if (zmq_curve_keypair(out->public_z85, out->secret_z85) != 0)
        return zfail("zmq_curve_keypair", err, errlen);
    char path[4100], text[512];
    snprintf(path, sizeof path, "%s.key", prefix);
    snprintf(text, sizeof text,
             "# k3shard CURVE key pair (k3-coordinator keygen). Secret: keep it mode 0600.\n"
             "public = %s\nsecret = %s\n",
             out->public_z85, out->secret_z85);
    k3_status st = write_file(path, text, 0600, err, errlen);
    memset(text, 0, sizeof text);
    if (st) return st;
    snprintf(path, sizeof path, "%s.pub", prefix);
    snprintf(text, sizeof text, "# k3shard CURVE public key\npublic = %s\n", out->public_z85);
    return write_file(path, text, 0644, err, errlen);
}

k3_status k3_link_secret_load(const char *path, k3_curve_keypair *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    char *buf;
    size_t len;
    k3_status st = read_small(path, K3_MAX_KEYFILE_BYTES, &buf, &len, 1, err, errlen);
    if (st) return st;
    int have_pub = 0, have_sec = 0, line_no = 0;
    for (char *p = buf, *nl; p < buf + len && !st; p = nl + 1) {
        nl = memchr(p, '\n', (size_t)(buf + len - p));
        if (!nl) nl = buf + len;
        line_no++;
        size_t n;
        const char *s = trim(p, (size_t)(nl - p), &n);
        if (n == 0 || s[0] == '#') continue;
        char tmp[16];
        if (n > 6 && !memcmp(s, "public", 6)) {
            st = parse_key_line(s, n, "public", out->public_z85, tmp, sizeof tmp);
            have_pub = !st;
        } else if (n > 6 && !memcmp(s, "secret", 6)) {
            st = parse_key_line(s, n, "secret", out->secret_z85, tmp, sizeof tmp);
            have_sec = !st;
        } else {
            st = K3_ERR_FORMAT;
        }
        /* never quote a line of a secret file: it may be the key */
        if (st)
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "%s: line %d is not 'public = <40 Z85>' "
                         "or 'secret = <40 Z85>'",
                         path, line_no);
    }
    memset(buf, 0, len);
    free(buf);
    if (!st && (!have_pub || !have_sec))
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: missing the %s key line", path,
                     have_pub ? "secret" : "public");
    if (!st) {
        char derived[K3_Z85_KEY_LEN + 1];
        if (zmq_curve_public(derived, out->secret_z85) != 0 ||
            strcmp(derived, out->public_z85) != 0)
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "%s: the public key does not belong to the secret key", path);
    }
    if (st) memset(out, 0, sizeof *out);
    return st;
}

k3_status k3_allow_list_load(const char *path, k3_allow_list *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    char *buf;
    size_t len;
    k3_status st = read_small(path, K3_MAX_KEYFILE_BYTES, &buf, &len, 0, err, errlen);
    if (st) return st;
    out->keys = k3_xcalloc(K3_MAX_ALLOW_KEYS, sizeof *out->keys);
    int line_no = 0;
    for (char *p = buf, *nl; p < buf + len && !st; p = nl + 1) {
        nl = memchr(p, '\n', (size_t)(buf + len - p));
        if (!nl) nl = buf + len;
        line_no++;
        size_t n;
        const char *s = trim(p, (size_t)(nl - p), &n);
        if (n == 0 || s[0] == '#') continue;
        char z[K3_Z85_KEY_LEN + 1];
        st = parse_key_line(s, n, "public", z, err, errlen);
        if (st) {
            k3_err_prefix(err, errlen, "%s: line %d", path, line_no);
            break;
        }
        if (out->n >= K3_MAX_ALLOW_KEYS) {
            st = k3_errf(K3_ERR_LIMIT, err, errlen, "%s: more than %d keys (K3_MAX_ALLOW_KEYS)",
                         path, K3_MAX_ALLOW_KEYS);
            break;
        }
        zmq_z85_decode(out->keys[out->n++], z);
    }
    free(buf);
    if (!st && out->n == 0)
        st = k3_errf(K3_ERR_ARG, err, errlen, "%s: no public key in the allow-list", path);
    if (st) k3_allow_list_free(out);
    return st;
}

void k3_allow_list_free(k3_allow_list *l) {
    if (!l) return;
    free(l->keys);
    l->keys = NULL;
    l->n = 0;
}

int k3_allow_list_has(const k3_allow_list *l, const uint8_t key[32]) {
    for (int i = 0; i < l->n; i++)
        if (!memcmp(l->keys[i], key, 32)) return 1;
    return 0;
}

/* Lines "ENDPOINT KEY" or "* KEY" ('#' comments); the last line naming ep
 * wins, else the last "*" line. */
k3_status k3_link_worker_key(const char *path, const char *ep, char out[K3_Z85_KEY_LEN + 1],
                             char *err, size_t errlen) {
    out[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", path, strerror(errno));
    char line[1024], star[K3_Z85_KEY_LEN + 1] = "";
    int line_no = 0;
    k3_status st = K3_OK;
    while (fgets(line, sizeof line, f)) {
        line_no++;
        if (line_no > K3_MAX_ALLOW_KEYS) {
            st = k3_errf(K3_ERR_LIMIT, err, errlen, "%s: more than %d lines", path,
                         K3_MAX_ALLOW_KEYS);
            break;
        }
        char e[K3_MAX_ENDPOINT], k[128];
        if (line[0] == '#' || sscanf(line, "%255s %127s", e, k) != 2) continue;
        char z[K3_Z85_KEY_LEN + 1];
        if ((st = k3_link_public_parse(k, z, err, errlen))) {
            k3_err_prefix(err, errlen, "%s: line %d", path, line_no);
            break;
        }
        if (!strcmp(e, ep))
            snprintf(out, K3_Z85_KEY_LEN + 1, "%s", z);
        else if (!strcmp(e, "*"))
            snprintf(star, sizeof star, "%s", z);
    }
    fclose(f);
    if (!st && !out[0]) snprintf(out, K3_Z85_KEY_LEN + 1, "%s", star);
    return st;
}

k3_status k3_link_curve_server(void *sock, const k3_curve_keypair *kp, char *err, size_t errlen) {
    k3_status st = set_int(sock, ZMQ_CURVE_SERVER, 1, "ZMQ_CURVE_SERVER", err, errlen);
    if (!st && zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp->secret_z85, K3_Z85_KEY_LEN) != 0)
        st = zfail("setsockopt ZMQ_CURVE_SECRETKEY", err, errlen);
    if (!st && zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, K3_ZAP_DOMAIN, strlen(K3_ZAP_DOMAIN)) != 0)
        st = zfail("setsockopt ZMQ_ZAP_DOMAIN", err, errlen);
    if (!st)
        st = set_int(sock, ZMQ_ZAP_ENFORCE_DOMAIN, 1, "ZMQ_ZAP_ENFORCE_DOMAIN (93)", err, errlen);
    return st;
}

k3_status k3_link_curve_client(void *sock, const k3_curve_keypair *kp, const char *server_z85,
                               char *err, size_t errlen) {
    if (!server_z85 || strlen(server_z85) != K3_Z85_KEY_LEN)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "CURVE client: server key must be %d Z85 characters", K3_Z85_KEY_LEN);
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server_z85, K3_Z85_KEY_LEN) != 0)
        return zfail("setsockopt ZMQ_CURVE_SERVERKEY", err, errlen);
    if (zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, kp->public_z85, K3_Z85_KEY_LEN) != 0)
        return zfail("setsockopt ZMQ_CURVE_PUBLICKEY", err, errlen);
    if (zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp->secret_z85, K3_Z85_KEY_LEN) != 0)
        return zfail("setsockopt ZMQ_CURVE_SECRETKEY", err, errlen);
    return K3_OK;
}

/* ---- ZAP handler ---- */

struct k3_zap {
    void *sock; /* REP on inproc://zeromq.zap.01, owned by the thread */
    pthread_t thread;
    atomic_int stop;
    atomic_ullong refused;
    const k3_allow_list *allow; /* borrowed */
};

#define ZAP_MAX_FRAMES 10

static void zap_reply(void *s, const zmq_msg_t *reqid, const char *code, const char *text) {
    zmq_send(s, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(s, reqid ? zmq_msg_data((zmq_msg_t *)reqid) : "",
             reqid ? zmq_msg_size((zmq_msg_t *)reqid) : 0, ZMQ_SNDMORE);
    zmq_send(s, code, strlen(code), ZMQ_SNDMORE);
    zmq_send(s, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(s, "", 0, ZMQ_SNDMORE); /* user id */
    zmq_send(s, "", 0, 0);           /* metadata */
}

/* One request: version, request id, domain, address, identity, mechanism,
 * credentials... (RFC 27). Anything but a listed CURVE key is refused. The
 * REP socket must answer every request it reads, malformed or not, or it
 * cannot read the next one; only libzmq itself can reach this inproc
 * endpoint, so a malformed request would be a libzmq bug. */
static void zap_handle(k3_zap *z) {
    zmq_msg_t f[ZAP_MAX_FRAMES];
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, z->sock, 0) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (n < ZAP_MAX_FRAMES)
            f[n++] = m;
        else
            zmq_msg_close(&m);
    }
    const char *why = NULL;
    char key_z85[K3_Z85_KEY_LEN + 1] = "?";
    if (n < 6 || zmq_msg_size(&f[0]) != 3 || memcmp(zmq_msg_data(&f[0]), "1.0", 3))
        why = "malformed ZAP request";
    else if (zmq_msg_size(&f[2]) != strlen(K3_ZAP_DOMAIN) ||
             memcmp(zmq_msg_data(&f[2]), K3_ZAP_DOMAIN, strlen(K3_ZAP_DOMAIN)))
        why = "wrong ZAP domain";
    else if (zmq_msg_size(&f[5]) != 5 || memcmp(zmq_msg_data(&f[5]), "CURVE", 5))
        why = "mechanism is not CURVE";
    else if (n != 7 || zmq_msg_size(&f[6]) != 32)
        why = "malformed CURVE credentials";
    else {
        zmq_z85_encode(key_z85, zmq_msg_data(&f[6]), 32);
        if (!k3_allow_list_has(z->allow, zmq_msg_data(&f[6]))) why = "key not on the allow-list";
    }
    if (why) {
        atomic_fetch_add(&z->refused, 1);
        char addr[64] = "";
        if (n > 3) {
            size_t an =
                zmq_msg_size(&f[3]) < sizeof addr - 1 ? zmq_msg_size(&f[3]) : sizeof addr - 1;
            memcpy(addr, zmq_msg_data(&f[3]), an);
            addr[an] = 0;
            for (size_t i = 0; i < an; i++)
                if ((unsigned char)addr[i] < 0x20 || addr[i] == 0x7f) addr[i] = '?';
        }
        K3_WARN("CURVE client refused: %s (public key %s, address %s)", why, key_z85,
                addr[0] ? addr : "?");
        zap_reply(z->sock, n > 1 ? &f[1] : NULL, "400", why);
    } else {
        K3_DEBUG("CURVE client admitted (public key %s)", key_z85);
        zap_reply(z->sock, &f[1], "200", "OK");
    }
    for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
}

/* Polls with a short timeout so that k3_zap_close (which sets stop) never
 * waits more than 100 ms for the thread. */
static void *zap_thread(void *arg) {
    k3_zap *z = arg;
    while (!atomic_load(&z->stop)) {
        zmq_pollitem_t it = {z->sock, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&it, 1, 100);
        if (rc < 0 && zmq_errno() != EINTR) break;
        if (rc > 0 && (it.revents & ZMQ_POLLIN)) zap_handle(z);
    }
    zmq_close(z->sock);
    return NULL;
}

k3_status k3_zap_open(k3_zap **out, void *ctx, const k3_allow_list *allow, char *err,
                      size_t errlen) {
    *out = NULL;
    if (!allow || allow->n < 1)
        return k3_errf(K3_ERR_ARG, err, errlen, "ZAP handler: empty allow-list");
    k3_zap *z = k3_xcalloc(1, sizeof *z);
    z->allow = allow;
    z->sock = zmq_socket(ctx, ZMQ_REP);
    if (!z->sock) {
        free(z);
        return zfail("ZAP handler: zmq_socket", err, errlen);
    }
    int linger = 0;
    zmq_setsockopt(z->sock, ZMQ_LINGER, &linger, sizeof linger);
    /* Bound here, in the caller's thread, so it exists before any server
     * socket binds (RFC 27: the handler starts first). */
    if (zmq_bind(z->sock, K3_ZAP_ENDPOINT) != 0) {
        k3_status st = zfail("ZAP handler: bind " K3_ZAP_ENDPOINT, err, errlen);
        zmq_close(z->sock);
        free(z);
        return st;
    }
    if (pthread_create(&z->thread, NULL, zap_thread, z) != 0) {
        zmq_close(z->sock);
        free(z);
        return k3_errf(K3_ERR_INTERNAL, err, errlen, "ZAP handler: cannot start its thread");
    }
    *out = z;
    return K3_OK;
}

void k3_zap_close(k3_zap **zp) {
    if (!zp || !*zp) return;
    k3_zap *z = *zp;
    atomic_store(&z->stop, 1);
    pthread_join(z->thread, NULL);
    free(z);
    *zp = NULL;
}

uint64_t k3_zap_refused(const k3_zap *z) { return z ? atomic_load(&((k3_zap *)z)->refused) : 0; }

/* ---- numerics ---- */

#ifndef K3_BUILD_REV
#define K3_BUILD_REV "unknown"
#endif

const char *k3_link_build(void) { return K3_LINK_BUILD " rev " K3_BUILD_REV; }

k3_status k3_link_check_build(const char *want, const char *want_side, const char *got,
                              const char *got_side, char *err, size_t errlen) {
    if (!strcmp(want, got)) return K3_OK;
    return k3_errf(K3_ERR_MISMATCH, err, errlen,
                   "build identity mismatch: %s '%s', %s '%s' (deploy the same build on every "
                   "host)",
                   want_side, want, got_side, got);
}

void k3_link_numerics(int bits, int mla_bits, int head_bits, int idot, int dense_idot, int exact,
                      proto_numerics *out) {
    memset(out, 0, sizeof *out);
    out->bits = (uint32_t)bits;
    out->mla_bits = (uint32_t)mla_bits;
    out->head_bits = (uint32_t)head_bits;
    out->idot = idot != 0;
    out->dense_idot = dense_idot != 0;
    out->isa = (uint32_t)k3_isa_active();
    out->exact = exact != 0;
}

/* ---- closing after the peer ------------------------------------------- */

static void drain(void *sock) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    while (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) >= 0) {
    }
    zmq_msg_close(&m);
}

int k3_link_monitor_event(void *mon) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, mon, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&m);
        return -1;
    }
    uint16_t ev = 0;
    if (zmq_msg_size(&m) >= 2) memcpy(&ev, zmq_msg_data(&m), 2);
    while (zmq_msg_more(&m) && zmq_msg_recv(&m, mon, 0) >= 0) {
    }
    zmq_msg_close(&m);
    return ev;
}

/* 1 if one of mon's waiting events is DISCONNECTED (all are consumed) */
static int saw_disconnect(void *mon) {
    int seen = 0;
    for (int ev; (ev = k3_link_monitor_event(mon)) >= 0;)
        if (ev == ZMQ_EVENT_DISCONNECTED) seen = 1;
    return seen;
}

int k3_link_await_peer_close(void *const *socks, void *const *mons, int n, int wait_ms) {
    if (n <= 0) return 0;
    zmq_pollitem_t *items = k3_xcalloc((size_t)n * 2, sizeof *items);
    int *who = k3_xcalloc((size_t)n * 2, sizeof *who);
    char *closed = k3_xcalloc((size_t)n, 1);
    int n_closed = 0;
    const double until = k3_now_ms() + wait_ms;
    for (;;) {
        int k = 0;
        for (int i = 0; i < n; i++) {
            if (!socks[i] || !mons[i] || closed[i]) continue;
            items[k] = (zmq_pollitem_t){socks[i], 0, ZMQ_POLLIN, 0};
            who[k++] = i;
            items[k] = (zmq_pollitem_t){mons[i], 0, ZMQ_POLLIN, 0};
            who[k++] = n + i;
        }
        const double left = until - k3_now_ms();
        if (k == 0 || left <= 0) break;
        if (zmq_poll(items, k, (long)left + 1) < 0 && zmq_errno() != EINTR) break;
        for (int j = 0; j < k; j++) {
            if (!(items[j].revents & ZMQ_POLLIN)) continue;
            if (who[j] < n)
                drain(socks[who[j]]);
            else if (saw_disconnect(mons[who[j] - n]))
                closed[who[j] - n] = 1, n_closed++;
        }
    }
    for (int i = 0; i < n; i++)
        if (socks[i]) drain(socks[i]);
    free(items);
    free(who);
    free(closed);
    return n_closed;
}
