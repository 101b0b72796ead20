/* coordinator/cmd_web.h: `k3-coordinator web`, the chat page (docs/WEB.md).
 *
 *   k3-coordinator web --model DIR [every serve option]
 *
 * Is `k3-coordinator serve` (coordinator/serve.h: same options, same API,
 * same shutdown) that also prints the URL of the chat page once the server
 * listens. Threads: called from main() on the main thread.
 * Returns serve's exit code.
 */
#ifndef K3_CMD_WEB_H
#define K3_CMD_WEB_H

int cmd_web(int argc, char **argv);

#endif
