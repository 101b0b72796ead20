/* coordinator/cmd_chat.h: the `k3-coordinator chat` subcommand, an
 * interactive chat prompt over one engine (docs/CHAT.md).
 *
 *   k3-coordinator chat --model DIR [--local N | --workers EP,...]
 *                       [--system TEXT] [--think on|off] [--ngen N] [--temp T]
 *
 * Owns: its option table, the engine it opens (coordinator/engine.h, one
 * session), the conversation (coordinator/chat_conv.h), the terminal
 * (coordinator/chat_term.h) and the SIGINT handler while it runs.
 * Threads: called from main() on the main thread, before any other.
 * Returns the exit code: 0 at Ctrl-D, :q or the end of piped input, 1 on a
 * runtime error (the model cannot be opened, no tokenizer), 2 bad usage.
 */
#ifndef K3_CMD_CHAT_H
#define K3_CMD_CHAT_H

int cmd_chat(int argc, char **argv);

#endif
