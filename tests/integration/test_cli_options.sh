#!/usr/bin/env bash
# tests/integration/test_cli_options.sh: the k3-coordinator options a power
# user expects (docs/CLUSTER.md "Command line"), on tiny in-process.
#  - the prompt from --file and from standard input ('-') gives the ids of
#    the same text as an argument; a 200 KB prompt (past the argument list
#    limit for one argument) is read from a file and from stdin;
#  - --stop cuts the text before the string and ends the run (exit 0,
#    "stop: stop string"); --ignore-eos runs past an eos id to --ngen;
#  - --top-k / --min-p / --repeat-penalty: reproducible per seed, and
#    --top-k 1 is greedy at any temperature;
#  - --chat renders one turn (with --system) and stops at the end of the
#    turn; --think=0 changes the prompt;
#  - --help lists keygen, --quiet, --log-level and every variable; --quiet
#    leaves only warnings; log lines carry a time.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C"
make_tmp cli_options
export K3_LOG=info
run() { "$C" --model "$TINY" --local 0 --threads 1 --print-ids "$@"; }
ids() { grep '^ids:' "$1"; }

printf 'The quick brown fox' >"$T/p.txt"
run --ngen 6 "The quick brown fox" >"$T/arg.out" 2>"$T/arg.err"
run --ngen 6 --file "$T/p.txt" >"$T/file.out" 2>"$T/file.err"
run --ngen 6 - <"$T/p.txt" >"$T/stdin.out" 2>"$T/stdin.err"
if [ -n "$(ids "$T/arg.out")" ] && [ "$(ids "$T/arg.out")" = "$(ids "$T/file.out")" ] &&
    [ "$(ids "$T/arg.out")" = "$(ids "$T/stdin.out")" ]; then
    ok "--file and '-' (stdin): the ids of the same text given as an argument"
else
    bad "--file / stdin differ: $(tail -1 "$T/file.err") / $(tail -1 "$T/stdin.err")"
fi
/usr/bin/python3 -c "print('word ' * 40000)" >"$T/big.txt"
run --ngen 2 --max-ctx 100 --file "$T/big.txt" >/dev/null 2>"$T/big.err"
run --ngen 2 --max-ctx 100 - <"$T/big.txt" >/dev/null 2>"$T/big2.err"
if grep -q 'prompt of 80004 tokens is longer than the context of 100' "$T/big.err" &&
    grep -q 'prompt of 80004 tokens' "$T/big2.err"; then
    ok "a 200 KB prompt is read from --file and from stdin (80004 tokens, then the context check)"
else
    bad "200 KB prompt: $(tail -1 "$T/big.err")"
fi
run --ngen 8 "The quick brown fox" --stop " fir" >"$T/stop.out" 2>"$T/stop.err"
rc=$?
if [ $rc -eq 0 ] && [ "$(head -1 "$T/stop.out")" = " feel foo" ] &&
    grep -q 'stop: stop string' "$T/stop.err" && [ "$(ids "$T/stop.out")" = "ids: 1050 1049 1048" ]; then
    ok "--stop ' fir': text cut before it, 3 tokens, 'stop: stop string', exit 0"
else
    bad "--stop (rc $rc): '$(head -1 "$T/stop.out")' $(tail -1 "$T/stop.err")"
fi
run --ngen 6 --ids 1285 >"$T/eos.out" 2>"$T/eos.err"
run --ngen 6 --ids 1285 --ignore-eos >"$T/ieos.out" 2>"$T/ieos.err"
if [ "$(ids "$T/eos.out")" = "ids: 1284 1283 1282" ] && grep -q 'stop: eos' "$T/eos.err" &&
    [ "$(ids "$T/ieos.out")" = "ids: 1284 1283 1282 1281 1280 1279" ]; then
    ok "--ignore-eos: past the eos id 1282 to --ngen 6"
else
    bad "--ignore-eos: $(ids "$T/eos.out") / $(ids "$T/ieos.out")"
fi
samp=(--ngen 12 --temp 0.9 --top-k 20 --min-p 0.05 --repeat-penalty 1.3 "The quick")
run "${samp[@]}" --seed 4 >"$T/s1.out" 2>/dev/null
run "${samp[@]}" --seed 4 >"$T/s2.out" 2>/dev/null
run --ngen 12 --temp 3 --top-k 1 --seed 9 "The quick" >"$T/k1.out" 2>/dev/null
run --ngen 12 "The quick" >"$T/greedy.out" 2>/dev/null
if [ -n "$(ids "$T/s1.out")" ] && [ "$(ids "$T/s1.out")" = "$(ids "$T/s2.out")" ] &&
    [ "$(ids "$T/k1.out")" = "$(ids "$T/greedy.out")" ]; then
    ok "--top-k/--min-p/--repeat-penalty reproducible per seed; --top-k 1 at --temp 3 is greedy"
else
    bad "sampling options: $(ids "$T/s1.out") / $(ids "$T/s2.out"); $(ids "$T/k1.out") vs $(ids "$T/greedy.out")"
fi
if run --ngen 3 "x" --top-k -1 2>"$T/bad.err"; then
    bad "--top-k -1 accepted"
elif [ $? -eq 2 ] && grep -q -- '--top-k: -1 is outside' "$T/bad.err"; then
    ok "--top-k -1 is a usage error: $(tail -1 "$T/bad.err")"
else
    bad "--top-k -1: $(tail -1 "$T/bad.err")"
fi
run --ngen 8 --chat hello --system "be brief" >"$T/chat.out" 2>"$T/chat.err"
rc=$?
run --ngen 8 --chat hello --system "be brief" --think=0 >"$T/chat0.out" 2>"$T/chat0.err"
p1=$(grep -o 'prompt [0-9]* tokens' "$T/chat.err")
p0=$(grep -o 'prompt [0-9]* tokens' "$T/chat0.err")
if [ $rc -eq 0 ] && grep -q 'stop: end of turn' "$T/chat.err" && [ -n "$p1" ] && [ "$p1" != "$p0" ]; then
    ok "--chat with --system: one turn, 'stop: end of turn'; --think=0 renders another prompt ($p1 / $p0)"
else
    bad "--chat (rc $rc): $(tail -1 "$T/chat.err") ($p1 / $p0)"
fi
"$C" --help >"$T/help.txt"
miss=""
for w in keygen --quiet --log-level --file --chat --system --think --stop --top-k --min-p \
    --repeat-penalty --ignore-eos --ready-timeout-ms K3_LOG K3_THINK K3_USAGE_SAVE K3_LAYERS K3_TOPP; do
    grep -q -- "$w" "$T/help.txt" || miss="$miss $w"
done
if [ -z "$miss" ]; then
    ok "--help names keygen, --quiet, --log-level, the new options and the variables"
else
    bad "--help lacks:$miss"
fi
run --ngen 2 "x" -q >"$T/q.out" 2>"$T/q.err"
run --ngen 2 "x" >"$T/v.out" 2>"$T/v.err"
if [ ! -s "$T/q.err" ] && grep -Eq '^[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3} \[k3-coordinator\] info: ' "$T/v.err"; then
    ok "-q: nothing on stderr; log lines start with HH:MM:SS.mmm"
else
    bad "-q / timestamps: $(head -2 "$T/q.err") | $(head -1 "$T/v.err")"
fi
exit $fail
