/* coordinator/chat_term.h: the terminal side of `k3-coordinator chat`
 * (docs/CHAT.md): reading a message with libedit, and the prefill spinner.
 *
 * Owns: the libedit line editor and its history (loaded from and saved to
 * the history file after every message), the message being assembled from
 * several lines (a trailing backslash, a triple-quote block, a bracketed
 * paste), and the spinner thread.
 * Borrows: stdin / stdout, which must be terminals while a chat_term is
 * open (cmd_chat uses plain stdio otherwise).
 * Threads: every call on the main thread; the spinner has a thread of its
 * own that writes only between chat_spin_start and chat_spin_stop, while
 * the main thread writes nothing to stdout.
 *
 * Ctrl-C while editing is a key, not a signal (the editor turns ISIG off
 * in its edit mode): it drops the line and chat_term_read reports it.
 */
#ifndef K3_CHAT_TERM_H
#define K3_CHAT_TERM_H

#include <stddef.h>

#include "common/base/err.h"

typedef struct chat_term chat_term;

/* Opens the editor on stdin/stdout with the history file hist_path (its
 * directory is created; NULL = no history file). A history file that cannot
 * be read or created is a warning, not an error. */
k3_status chat_term_open(chat_term **out, const char *hist_path, char *err, size_t errlen);
/* Saves the history, restores the terminal; NULL is fine; nulls *t. */
void chat_term_close(chat_term **t);

typedef enum chat_read {
    CHAT_READ_MSG = 0, /* *msg holds a message (malloc'd, UTF-8, no final newline) */
    CHAT_READ_EOF,     /* Ctrl-D on an empty line */
    CHAT_READ_INTR     /* Ctrl-C on an empty line (on typed text it drops the text
                          and the message being assembled, and reads on) */
} chat_read;

/* Reads one message at prompt "> " (continuation lines: "... "). A line
 * ending in a backslash continues on the next line; a line starting with
 * three double quotes opens a block that ends at a line ending in them; a
 * bracketed paste with several lines is kept whole and the message goes
 * when Enter is pressed. Non-empty messages enter the history. */
chat_read chat_term_read(chat_term *t, char **msg);

/* The default history file: $XDG_DATA_HOME/k3shard/history, else
 * $HOME/.local/share/k3shard/history; NULL without either (malloc'd). */
char *chat_term_history_path(void);

/* ---- spinner --------------------------------------------------------------- */

typedef struct chat_spin chat_spin;

/* Starts "⠋ LABEL Ns" on stdout, redrawn ten times a second; after the
 * first second it also shows the percentage of chat_spin_progress. */
chat_spin *chat_spin_start(const char *label);
/* done of n (n > 0); any thread. */
void chat_spin_progress(chat_spin *s, int done, int n);
/* Stops the thread and erases the line; NULL is fine; nulls *s. */
void chat_spin_stop(chat_spin **s);

#endif
