#!/usr/bin/env bash
# tests/integration/test_settings_cli.sh: settings that used to be read
# straight from the environment, now rows of the programs' option tables
# (common/base/opts.h), seen from the command line:
#  - --log-level / K3_LOG and --isa / K3_ISA are in both programs' --help; a
#    bad value of either variable is a usage error (exit 2) naming the
#    variable, the value and the allowed words; the flag beats the variable;
#  - --worker-bin / K3_WORKER_BIN picks the program of --local workers;
#  - a --local request with many long --dirs reaches the workers whole
#    (coordinator/cluster_local.c sizes argv from it) and gives the same ids
#    as --local 0 (tests/test_cluster.c passes hundreds of worker arguments).
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp k3set
unset K3_LOG K3_ISA K3_WORKER_BIN

for prog in "$C" "$W"; do
    name=$(basename "$prog")
    "$prog" --help >"$T/help" 2>&1
    if grep -q -- '--log-level LEVEL .*(K3_LOG, default info, one of debug, info, warn, error)' "$T/help" &&
        grep -q -- '--isa ISA .*(K3_ISA, default auto, one of auto, scalar, avx2, avx512)' "$T/help"; then
        ok "$name --help lists --log-level (K3_LOG) and --isa (K3_ISA) with their words"
    else
        bad "$name --help: no --log-level / --isa line"
    fi
    K3_LOG=loud "$prog" --help >/dev/null 2>"$T/err"
    rc=$?
    if [ $rc -eq 2 ] && grep -q "K3_LOG=loud: must be one of debug, info, warn, error" "$T/err"; then
        ok "$name: K3_LOG=loud is a usage error naming the levels"
    else
        bad "$name: K3_LOG=loud: rc $rc, '$(cat "$T/err")'"
    fi
    K3_ISA=sse "$prog" --help >/dev/null 2>"$T/err"
    rc=$?
    if [ $rc -eq 2 ] && grep -q "K3_ISA=sse: must be one of auto, scalar, avx2, avx512" "$T/err"; then
        ok "$name: K3_ISA=sse is a usage error naming the levels"
    else
        bad "$name: K3_ISA=sse: rc $rc, '$(cat "$T/err")'"
    fi
done

IDS=5,7,9,11,13
gen() { # name args...: ids line in $T/name.ids, stderr in $T/name.err
    local name=$1
    shift
    "$C" --model "$TINY" --ids "$IDS" --ngen 4 --print-ids --threads 1 "$@" >"$T/$name.out" 2>"$T/$name.err"
    local rc=$?
    grep '^ids:' "$T/$name.out" >"$T/$name.ids"
    return $rc
}

gen ref --local 0 || bad "--local 0: $(tail -1 "$T/ref.err")"
# the flag beats the variable: K3_LOG=error would print no info line
if K3_LOG=error gen dbg --local 0 --log-level debug && grep -q '\] debug: ' "$T/dbg.err"; then
    ok "--log-level debug beats K3_LOG=error (debug lines on stderr)"
else
    bad "--log-level debug under K3_LOG=error: $(tail -1 "$T/dbg.err")"
fi
if K3_LOG=error gen quiet --local 0 && ! grep -q '\] info: ' "$T/quiet.err"; then
    ok "K3_LOG=error: no info lines"
else
    bad "K3_LOG=error still printed info lines"
fi
if gen scalar --local 0 --isa scalar && cmp -s "$T/scalar.ids" "$T/ref.ids"; then
    ok "--isa scalar: the same ids as the detected level"
else
    bad "--isa scalar: $(tail -1 "$T/scalar.err")"
fi

# --worker-bin: a program that is not there fails the start, naming it; the
# variable names the real one, the flag beats it
K3_WORKER_BIN="$W" gen wb_flag --local 1 --worker-bin "$T/no-such-worker"
rc=$?
if [ $rc -ne 0 ] && grep -q "exited during start-up" "$T/wb_flag.err"; then
    ok "--worker-bin beats K3_WORKER_BIN: a missing program fails the start"
else
    bad "--worker-bin $T/no-such-worker: rc $rc, $(tail -1 "$T/wb_flag.err")"
fi
if K3_WORKER_BIN="$W" gen wb_env --local 1 && cmp -s "$T/wb_env.ids" "$T/ref.ids"; then
    ok "K3_WORKER_BIN=$W: --local 1 runs, ids as --local 0"
else
    bad "K3_WORKER_BIN: $(tail -1 "$T/wb_env.err")"
fi

# a large --local request: 16 shard directories of ~430 bytes each, over
# the 4 KiB the joined list once had
dirs=""
long=$(printf 'd%.0s' $(seq 1 200))
for i in $(seq 1 16); do
    d="$T/$long/dir$i-$long"
    mkdir -p "$d"
    dirs="${dirs:+$dirs,}$d"
done
if gen big --local 2 --dirs "$dirs" && cmp -s "$T/big.ids" "$T/ref.ids"; then
    ok "--local 2 with 16 long --dirs ($(printf %s "$dirs" | wc -c) bytes): ids as --local 0"
else
    bad "--local 2 with 16 long --dirs: $(tail -1 "$T/big.err")"
fi
exit $fail
