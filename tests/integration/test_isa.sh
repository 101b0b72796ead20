#!/usr/bin/env bash
# tests/integration/test_isa.sh: the whole model at every K3_ISA level
# (issue 7). All kernels (kernels.h) and layer operators (ops_isa.h) share
# one summation order, so the levels must agree byte for byte:
#  - k3-coordinator --local 0 on the tiny checkpoint, in --exact and in the
#    default quantized numerics and with --dense-idot (int8 activations for
#    the dense matrices too): the --all-logits file (every prompt
#    position), the --trace file (hidden state after every layer) and the
#    generated ids are identical (cmp) at scalar, avx2 and avx512, at chunk
#    32 and chunk 1;
#  - a mixed-ISA cluster (one k3-worker at scalar, one at the best level)
#    registers, warns naming both levels, and gives the same logits and
#    ids as --local 0.
# A level this CPU lacks is skipped with the reason the binary prints.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
[ -f "$TINY/config.json" ] || { echo "not ok - tiny checkpoint missing at $TINY"; exit 1; }
make_tmp k3isa
export K3_LOG=warn

IDS=$(/usr/bin/python3 -c 'import random; r=random.Random(11); print(",".join(str(r.randrange(1280)) for _ in range(37)))')

run() {  # name isa args...: $T/name.{f32,trace,ids,err}
    local name=$1 isa=$2; shift 2
    K3_ISA=$isa "$C" --model "$TINY" --local 0 --ids "$IDS" --ngen 5 --print-ids --threads 2 \
        --all-logits "$T/$name.f32" --trace "$T/$name.trace" "$@" >"$T/$name.out" 2>"$T/$name.err"
    local rc=$?
    grep '^ids:' "$T/$name.out" >"$T/$name.ids"
    return $rc
}
same() {  # a b: logits, trace and ids byte-identical and non-empty
    cmp -s "$T/$1.f32" "$T/$2.f32" && cmp -s "$T/$1.trace" "$T/$2.trace" &&
        cmp -s "$T/$1.ids" "$T/$2.ids" && [ -s "$T/$1.f32" ] && [ -s "$T/$1.ids" ]
}

# the levels this CPU runs: a forced level above it makes the binary warn
LEVELS=()
for lv in scalar avx2 avx512; do
    if ! run probe "$lv" --exact; then
        bad "K3_ISA=$lv run failed: $(tail -1 "$T/probe.err")"
        continue
    fi
    if grep -q "supports up to" "$T/probe.err"; then
        skip "K3_ISA=$lv runs" "$(grep -m1 'supports up to' "$T/probe.err" | sed 's/^.*K3_ISA/K3_ISA/')"
    else
        LEVELS+=("$lv")
    fi
done
echo "# levels run: ${LEVELS[*]}"
[ "${#LEVELS[@]}" -ge 1 ] && [ "${LEVELS[0]}" = scalar ] || bad "the scalar level must always run"

for mode in exact default dense; do
    flag=""
    [ $mode = exact ] && flag=--exact
    [ $mode = dense ] && flag=--dense-idot
    for chunk in 32 1; do
        ref=""
        for lv in "${LEVELS[@]}"; do
            name=$mode.$chunk.$lv
            if ! run "$name" "$lv" $flag --chunk $chunk; then
                bad "$mode chunk $chunk K3_ISA=$lv failed: $(tail -1 "$T/$name.err")"
                continue
            fi
            if [ -z "$ref" ]; then
                ref=$name
                continue
            fi
            if same "$name" "$ref"; then
                ok "$mode, chunk $chunk: K3_ISA=$lv logits, per-layer trace and ids = scalar, byte for byte"
            else
                bad "$mode, chunk $chunk: K3_ISA=$lv differs from scalar" \
                    "(logits $(cmp "$T/$name.f32" "$T/$ref.f32" 2>&1 | head -c 120))"
            fi
        done
    done
    # chunk invariance at the best level
    best=${LEVELS[${#LEVELS[@]}-1]}
    if same "$mode.1.$best" "$mode.32.$best"; then
        ok "$mode: K3_ISA=$best chunk 1 = chunk 32, byte for byte"
    else
        bad "$mode: K3_ISA=$best chunk 1 differs from chunk 32"
    fi
done

# a mixed-ISA cluster: layers [0, 4) at scalar, [4, 8) at the best level
best=${LEVELS[${#LEVELS[@]}-1]}
if [ "$best" = scalar ]; then
    skip "mixed-ISA cluster" "this CPU runs only the scalar level"
else
    for mode in default exact dense; do
        flag=""
        [ $mode = exact ] && flag=--exact
        [ $mode = dense ] && flag=--dense-idot
        EP1="tcp://127.0.0.1:$(port)"
        EP2="tcp://127.0.0.1:$(port)"
        K3_ISA=scalar "$W" --model "$TINY" --layers 0-4 --listen "$EP1" --threads 1 --no-bench \
            --name wscalar $flag 2>>"$T/workers.log" &
        w1=$!
        K3_ISA=$best "$W" --model "$TINY" --layers 4-8 --listen "$EP2" --threads 1 --no-bench \
            --name "w$best" $flag 2>>"$T/workers.log" &
        w2=$!
        PIDS+=($w1 $w2)
        K3_ISA=$best "$C" --model "$TINY" --workers "$EP1,$EP2" --ids "$IDS" --ngen 5 --print-ids \
            --all-logits "$T/mixed.$mode.f32" $flag >"$T/mixed.$mode.out" 2>"$T/mixed.$mode.err"
        rc=$?
        grep '^ids:' "$T/mixed.$mode.out" >"$T/mixed.$mode.ids"
        if [ $rc -eq 0 ] && cmp -s "$T/mixed.$mode.f32" "$T/$mode.32.$best.f32" &&
            cmp -s "$T/mixed.$mode.ids" "$T/$mode.32.$best.ids" && [ -s "$T/mixed.$mode.ids" ]; then
            ok "$mode: mixed-ISA cluster (scalar + $best workers) = --local 0, byte for byte"
        else
            bad "$mode: mixed-ISA cluster (rc $rc) differs from --local 0: $(tail -2 "$T/mixed.$mode.err")"
        fi
        kill -TERM $w1 $w2 2>/dev/null
        wait $w1 $w2 2>/dev/null
    done
    if grep -q "runs ISA level scalar, this coordinator $best" "$T/mixed.default.err"; then
        ok "the coordinator warns about the scalar stage: $(grep -m1 'runs ISA level' "$T/mixed.default.err")"
    else
        bad "no ISA warning naming scalar and $best: $(tail -3 "$T/mixed.default.err")"
    fi
fi
exit $fail
