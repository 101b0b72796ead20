/* coordinator/cli_stop.h: graceful stop of the k3-coordinator command line
 * (docs/RELIABILITY.md "Stopping").
 *
 * Owns the process's SIGINT and SIGTERM dispositions and one atomic flag.
 * The first signal sets the flag, which the engine reads before every step
 * (k3_engine_req.cancel): the generation ends after the current step, and
 * main() prints what was generated, the ids line and the statistics, saves
 * the expert usage history and closes the cluster (SHUTDOWN to the
 * workers, their ipc directory removed). A second signal ends the process
 * at once (exit 128 + signal). Any thread may take the signal; the handler
 * only stores and writes.
 */
#ifndef K3_CLI_STOP_H
#define K3_CLI_STOP_H

#include <stdatomic.h>

/* Installs the handlers; returns the flag to put in k3_engine_req.cancel. */
const atomic_int *k3_cli_stop_install(void);
/* The signal that asked for the stop, 0 = none. */
int k3_cli_stop_signal(void);
/* Stops the generation after the current step without a signal (a --stop
 * string or the end of a --chat turn was seen); a later signal is still
 * the first one. */
void k3_cli_stop_request(void);

#endif
