/* coordinator/serve.h: the `k3-coordinator serve` subcommand, an
 * OpenAI-compatible HTTP server over one engine (docs/SERVING.md).
 *
 *   k3-coordinator serve --model DIR [--host 127.0.0.1] [--port 8080]
 *                        [--local N | --workers EP,...] [--api-key KEY]
 *                        [--max-queue N] [--ctx N] [--max-tokens N]
 *
 * Owns: the command line of the server (its own option table), the
 * libmicrohttpd daemon (a thread per connection), routing, authentication,
 * request bodies and the admission count; the engine (coordinator/
 * engine.h) it opens once. Requests are parsed and run by coordinator/
 * serve_api.h. Prints "serving on http://HOST:PORT" on stdout when ready.
 * SIGTERM / SIGINT: stop accepting, let requests in flight finish (at most
 * --drain-s seconds for the HTTP side; generations always run to their
 * end), close the engine (stopping local workers), exit 0.
 * Threads: called from main() on the main thread, before any other.
 * Returns the exit code: 0 after a signal, 1 runtime error, 2 bad usage.
 */
#ifndef K3_SERVE_H
#define K3_SERVE_H

int cmd_serve(int argc, char **argv);

#endif
