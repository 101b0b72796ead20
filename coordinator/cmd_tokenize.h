/* coordinator/cmd_tokenize.h: the `k3-coordinator tokenize` subcommand.
 *
 * Owns: the command line of the tokenizer tool. Borrows: common/tokenizer.
 * Called from main() (single thread) with argv[0] = "tokenize".
 *
 *   k3-coordinator tokenize --tokenizer DIR [--file F | TEXT] [--trusted]
 *   k3-coordinator tokenize --tokenizer DIR --decode [--file F | ID...]
 *
 * DIR needs only tiktoken.model and tokenizer_config.json. Encoding prints
 * the ids space-separated on one line; with neither --file nor TEXT the text
 * is read from stdin ("-" as F means stdin too). --trusted recognizes added
 * tokens such as <|open|> (the chat template's channel); by default they are
 * plain text. --decode reads ids (separated by spaces, commas or newlines)
 * and writes their bytes followed by one newline; an id outside the
 * vocabulary is an error. Returns the process exit code: 0 ok, 1 error
 * (message on stderr), 2 usage.
 */
#ifndef K3_CMD_TOKENIZE_H
#define K3_CMD_TOKENIZE_H

int cmd_tokenize(int argc, char **argv);

#endif
