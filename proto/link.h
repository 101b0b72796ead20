/* proto/link.h: the transport under the protocol, shared by k3-coordinator
 * and k3-worker (docs/PROTOCOL.md 1 and 9; docs/TESTING.md 6.2 and 6.3).
 *
 * Owns: the socket options every cluster socket gets (linger, heartbeats,
 * handshake and reconnect intervals, frame size limit), endpoint
 * classification (which endpoints may run without CURVE), CURVE key files
 * (keygen output, secret files checked for mode 0600 at load, allow-lists),
 * the --worker-keys file (each worker's server key), the ZAP handler thread
 * that makes a CURVE server fail closed, and the numeric settings HELLO
 * compares. The model fingerprint HELLO carries is the engine's
 * (k3_model_fingerprint_dir, common/engine/model.h): proto/ sees it as a
 * plain uint64_t and does not depend on the engine.
 * Borrows: the zmq context and sockets passed in (never closes them, except
 * the ZAP handler's own socket).
 * Threads: every function is reentrant; a k3_zap runs its own thread and is
 * opened/closed by one thread. Secret key bytes are never logged.
 *
 * Fail-closed CURVE (docs/TESTING.md 6.3): libzmq 4.3.4 accepts any client key
 * on a CURVE server when no ZAP handler answers, unless ZAP_DOMAIN is set
 * AND option 93 (ZMQ_ZAP_ENFORCE_DOMAIN, a draft constant hidden by the
 * stable header) is 1. k3_link_curve_server sets both; k3_zap_open must run
 * before the server socket binds.
 */
#ifndef K3_LINK_H
#define K3_LINK_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/base/opts.h"
#include "proto/proto.h"

/* Closing after the peer (docs/TESTING.md, "The libzmq shutdown
 * assertion"): a message that reaches a socket already closing, followed by
 * the peer's own close, can abort libzmq 4.3.4 (stream_engine_base.cpp:331
 * "!_io_error"). So the side that asked its peer to stop keeps its sockets
 * open and reads them until each peer has closed, then closes.
 * Reads and drops every message on socks[i] until mons[i] (a PAIR socket
 * connected to socks[i]'s monitor, which reports at least
 * ZMQ_EVENT_DISCONNECTED) shows the peer's close, for every i with both
 * non-NULL, or wait_ms pass. Returns how many peers closed in time. Closes
 * nothing; the caller's thread must own the sockets. */
int k3_link_await_peer_close(void *const *socks, void *const *mons, int n, int wait_ms);

/* The next event waiting on mon (a PAIR socket connected to a socket
 * monitor), read without blocking: its ZMQ_EVENT_* number, or -1 when none
 * waits. An event is two frames, [u16 event, u32 value] and the endpoint;
 * both are consumed. */
int k3_link_monitor_event(void *mon);

/* Build identity sent in HELLO / HELLO_OK: this prefix, then the source
 * revision the Makefile passes as K3_BUILD_REV (`git describe --always
 * --dirty`), e.g. "k3shard proto 1.3 rev 3f2a9c1". Both sides refuse a peer
 * whose identity differs (k3_link_check_build): the same settings with other
 * kernel code can give other bits. */
#define K3_LINK_BUILD "k3shard proto 1.3"

/* Heartbeat interval (HB): default and range, used by the option row
 * below, k3_link_sockopts_apply and k3_cluster_open alike. TTL = 3 x HB
 * (docs/TESTING.md 6.1); ZMTP carries TTL in deciseconds and libzmq needs it
 * < 60 s and >= 100 ms (libzmq #4226), hence 100..19000. */
#define K3_LINK_HB_MS_DEFAULT 1000
#define K3_LINK_HB_MS_MIN     100
#define K3_LINK_HB_MS_MAX     19000
#define K3_LINK_LIVENESS      3
/* ZMQ_HANDSHAKE_IVL of both programs' sockets: a stuck or refused CURVE
 * handshake fails after this (the coordinator's K3_HANDSHAKE_MS row). */
#define K3_LINK_HANDSHAKE_MS_DEFAULT 5000

/* Socket options of a cluster socket. */
typedef struct k3_link_sockopts {
    int hb_ms;        /* ZMTP HEARTBEAT_IVL; TIMEOUT and TTL are 3 x hb_ms; 0 = off */
    int linger_ms;    /* ZMQ_LINGER: pending messages are dropped after this on close */
    int handshake_ms; /* ZMQ_HANDSHAKE_IVL: a stuck or refused CURVE handshake fails fast */
} k3_link_sockopts;

/* hb_ms 0 (off) or in [K3_LINK_HB_MS_MIN, K3_LINK_HB_MS_MAX].
 * Sets LINGER, HEARTBEAT_IVL/TIMEOUT/TTL, HANDSHAKE_IVL, RECONNECT_IVL 100 ms
 * (max 2 s), SNDHWM/RCVHWM and ZMQ_MAXMSGSIZE (proto_socket_limit). Call
 * before bind/connect. */
k3_status k3_link_sockopts_apply(void *sock, const k3_link_sockopts *o, char *err, size_t errlen);

/* ---- endpoints ---- */

typedef enum k3_link_ep_kind {
    K3_EP_INVALID = 0,
    K3_EP_IPC,          /* ipc://path: one host, file permissions */
    K3_EP_INPROC,       /* inproc://name: one process (tests) */
    K3_EP_TCP_LOOPBACK, /* tcp://127.x.y.z, localhost, [::1] */
    K3_EP_TCP_NET       /* any other tcp:// (a network: CURVE required) */
} k3_link_ep_kind;

/* Classifies an endpoint; K3_EP_INVALID with a message naming it when the
 * syntax is wrong (unknown scheme, empty host, port missing or > 65535, an
 * ipc path over the 107-byte sun_path limit). */
k3_link_ep_kind k3_link_endpoint_kind(const char *ep, char *err, size_t errlen);

/* K3_ERR_AUTH when ep is a network tcp endpoint and neither CURVE is
 * configured (have_curve) nor insecure was asked for; `who` names the side
 * ("worker --listen", "coordinator --workers") in the message. */
k3_status k3_link_endpoint_policy(const char *ep, int have_curve, int insecure, const char *who,
                                  char *err, size_t errlen);

/* ---- CURVE keys ---- */

#define K3_Z85_KEY_LEN 40 /* a 32-byte key in Z85 */

typedef struct k3_curve_keypair {
    char public_z85[K3_Z85_KEY_LEN + 1];
    char secret_z85[K3_Z85_KEY_LEN + 1]; /* never logged */
} k3_curve_keypair;

/* Writes a new key pair: <prefix>.key (public + secret, created with mode
 * 0600, refused if it exists) and <prefix>.pub (public only, 0644). */
k3_status k3_link_keygen(const char *prefix, k3_curve_keypair *out, char *err, size_t errlen);

/* Loads a secret key file written by k3_link_keygen. Refuses (K3_ERR_AUTH) a
 * file readable or writable by group or others (mode wider than 0600), and
 * checks that the public key matches the secret one. */
k3_status k3_link_secret_load(const char *path, k3_curve_keypair *out, char *err, size_t errlen);

/* Parses one public key: 40 Z85 characters, or "public = <z85>". */
k3_status k3_link_public_parse(const char *text, char out_z85[K3_Z85_KEY_LEN + 1], char *err,
                               size_t errlen);

/* An allow-list of client public keys (32 raw bytes each). */
typedef struct k3_allow_list {
    int n;
    uint8_t (*keys)[32]; /* [n], owned */
} k3_allow_list;

/* Reads a file of public keys, one per line (bare Z85 or "public = Z85";
 * '#' comments and blank lines ignored), at most K3_MAX_ALLOW_KEYS. An
 * empty list is an error: it would refuse everyone. */
k3_status k3_allow_list_load(const char *path, k3_allow_list *out, char *err, size_t errlen);
void k3_allow_list_free(k3_allow_list *l);
int k3_allow_list_has(const k3_allow_list *l, const uint8_t key[32]);

/* The coordinator's --worker-keys file: lines "ENDPOINT KEY" (a bare Z85
 * key, as k3_link_public_parse reads it) or "* KEY" for every other
 * endpoint; '#' comment lines and lines without two words are skipped; at
 * most K3_MAX_ALLOW_KEYS lines. out receives the server key for ep (a line naming
 * it beats "*"), or "" when none applies. */
k3_status k3_link_worker_key(const char *path, const char *ep, char out[K3_Z85_KEY_LEN + 1],
                             char *err, size_t errlen);

/* Makes sock a CURVE server with this key pair, ZAP domain "k3shard" and
 * ZMQ_ZAP_ENFORCE_DOMAIN = 1 (fail closed). Before bind. */
k3_status k3_link_curve_server(void *sock, const k3_curve_keypair *kp, char *err, size_t errlen);
/* Makes sock a CURVE client of a server with public key server_z85. */
k3_status k3_link_curve_client(void *sock, const k3_curve_keypair *kp, const char *server_z85,
                               char *err, size_t errlen);

/* ---- ZAP handler (RFC 27) ---- */

typedef struct k3_zap k3_zap;

/* Binds inproc://zeromq.zap.01 in ctx (before any CURVE server binds) and
 * starts a thread answering 200 for CURVE clients whose key is on allow
 * (borrowed, must outlive the handler) and 400 for everyone else, logging
 * the Z85 public key of each refused client. */
k3_status k3_zap_open(k3_zap **out, void *ctx, const k3_allow_list *allow, char *err,
                      size_t errlen);
void k3_zap_close(k3_zap **z);
uint64_t k3_zap_refused(const k3_zap *z); /* clients refused so far */

/* ---- what HELLO compares ---- */

/* This build's identity (see K3_LINK_BUILD); a static string. */
const char *k3_link_build(void);

/* K3_ERR_MISMATCH naming both identities when got differs from want, e.g.
 * "build identity mismatch: coordinator 'k3shard proto 1.2 rev a', worker
 * '... rev b' (deploy the same build on every host)"; want_side and got_side
 * name the two peers. */
k3_status k3_link_check_build(const char *want, const char *want_side, const char *got,
                              const char *got_side, char *err, size_t errlen);

/* The numeric settings of a process: the engine's load-time bits and
 * integer-dot switches (k3_model_opts fields, passed as plain values), the
 * --exact switch, and the kernel level in use. */
void k3_link_numerics(int bits, int mla_bits, int head_bits, int idot, int dense_idot, int exact,
                      proto_numerics *out);

/* ---- option rows both programs use (common/base/opts.h tables) ----
 * One definition of the link settings each side of a link reads, so the
 * flag, variable, range and help cannot differ between k3-coordinator and
 * k3-worker. T: the program's option struct, f: its field. */
// clang-format off
#define K3_LINK_OPT_HB_MS(T, f)                                                                    \
    {.name = "hb_ms", .flag = "--hb-ms", .env = "K3_HB_MS", .type = K3_OPT_INT,                   \
     .offset = offsetof(T, f), .def = K3_OPT_STR(K3_LINK_HB_MS_DEFAULT),                          \
     .min = K3_LINK_HB_MS_MIN, .max = K3_LINK_HB_MS_MAX, .metavar = "MS",                         \
     .help = "heartbeat interval; a peer is dead after 3 silent intervals"}
#define K3_LINK_OPT_INSECURE(T, f)                                                                 \
    {.name = "insecure", .flag = "--insecure", .type = K3_OPT_BOOL, .offset = offsetof(T, f),     \
     .help = "allow plain tcp off loopback (no CURVE)"}
#define K3_LINK_OPT_CURVE_SECRET(T, f)                                                             \
    {.name = "curve_secret", .flag = "--curve-secret", .env = "K3_CURVE_SECRET",                  \
     .type = K3_OPT_STRING, .offset = offsetof(T, f), .metavar = "FILE",                          \
     .help = "this process's CURVE key pair (k3-coordinator keygen), mode 0600"}
// clang-format on

#endif
