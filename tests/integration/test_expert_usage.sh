#!/usr/bin/env bash
# tests/integration/test_expert_usage.sh: the expert usage history through
# the programs (K3_USAGE / --usage, K3_USAGE_SAVE; common/experts/experts.h).
#  - the in-process coordinator saves $XDG_CACHE_HOME/k3shard/<model
#    fingerprint>/usage by default, never into the model directory (a
#    read-only model directory works), and a given --usage PATH at exit;
#  - two --local workers, each saving its own layers' rows into one shared
#    file on their clean stop, leave the same history as the in-process run;
#  - logits and ids with the warm start equal those without (cmp);
#  - K3_USAGE_SAVE=0 leaves the file as it is; another model's history is
#    refused at start by the coordinator and by a k3-worker, naming it.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp k3usage
export K3_LOG=warn
unset K3_USAGE K3_USAGE_SAVE COLI_USAGE USAGE_SAVE

cp -r "$TINY" "$T/model"
rm -f "$T"/model/.k3_usage*
export XDG_CACHE_HOME="$T/cache"
unset K3_CACHE_DIR # it would win over XDG_CACHE_HOME (tests/run.sh sets one per run)
IDS=5,7,9,11,300,42,17,901
run() {  # name args...: logits in $T/name.f32, ids line in $T/name.ids
    local name=$1; shift
    "$C" --ids "$IDS" --ngen 4 --print-ids --threads 1 --all-logits "$T/$name.f32" "$@" \
        >"$T/$name.out" 2>"$T/$name.err"
    local rc=$?
    grep '^ids:' "$T/$name.out" >"$T/$name.ids"
    return $rc
}
same() { cmp -s "$T/$1.f32" "$T/$2.f32" && cmp -s "$T/$1.ids" "$T/$2.ids" && [ -s "$T/$1.ids" ]; }
rows() { tail -n +3 "$1" | sort; } # the counts, without the two header lines

# 1. default path, in-process; no history yet
if run cold --model "$T/model" --local 0 --usage off && [ ! -e "$T/model/.k3_usage" ]; then
    ok "--usage off: no history read or written"
else
    bad "--usage off: $(tail -1 "$T/cold.err")"
fi
chmod a-w "$T/model"
if run ref --model "$T/model" --local 0 && H=$(ls "$T"/cache/k3shard/*/usage 2>/dev/null) &&
    head -1 "$H" | grep -q '^-1 8 16$' && same cold ref && [ -z "$(ls -A "$T/model" | grep k3_usage)" ]; then
    ok "--local 0 saved ${H#"$T"/} at exit ($(wc -l <"$H") lines), nothing in the read-only model directory"
else
    bad "--local 0 did not save the history in the cache: $(tail -1 "$T/ref.err")"
    H="$T/none"
fi
chmod u+w "$T/model"

# 2. the warm start changes nothing in the results
cp "$H" "$T/hist1"
if run warm --model "$T/model" --local 0 && same warm ref; then
    ok "warm start from the history: logits and ids identical to the cold run"
else
    bad "warm start run differs or failed: $(tail -1 "$T/warm.err")"
fi
# the second run added its counts: every count doubled
if diff -q <(awk 'NR>2{print $1, $2, $3 * 2}' "$T/hist1" | sort) <(rows "$H") >/dev/null; then
    ok "a second run adds its selections to the loaded history (every count doubled)"
else
    bad "history after the second run is not twice the first"
fi

# 3. two local workers share one file: the same rows as the in-process run
if run l2 --model "$T/model" --local 2 --usage "$T/hist2" && same l2 ref &&
    diff -q <(rows "$T/hist1") <(rows "$T/hist2") >/dev/null; then
    ok "--local 2: both workers' rows merged into one file, equal to the in-process history"
else
    bad "--local 2 history differs from --local 0's: $(tail -1 "$T/l2.err")"
fi
if run l2w --model "$T/model" --local 2 --usage "$T/hist2" && same l2w ref &&
    diff -q <(awk 'NR>2{print $1, $2, $3 * 2}' "$T/hist1" | sort) <(rows "$T/hist2") >/dev/null; then
    ok "--local 2 warm from the shared file: same logits, counts accumulated"
else
    bad "--local 2 second run: $(tail -1 "$T/l2w.err")"
fi

# 4. K3_USAGE_SAVE=0: read only
cp "$T/hist2" "$T/hist2.before"
if K3_USAGE_SAVE=0 run ro --model "$T/model" --local 2 --usage "$T/hist2" &&
    cmp -s "$T/hist2" "$T/hist2.before"; then
    ok "K3_USAGE_SAVE=0: the history is left as it is (local workers too)"
else
    bad "K3_USAGE_SAVE=0 changed the history"
fi

# 5. another model's history is refused
printf -- '-1 9 16\n-2 1 1820578806\n1 1 3\n' >"$T/other"
run mis --model "$T/model" --local 0 --usage "$T/other"
rc=$?
if [ $rc -eq 1 ] && grep -q "usage history $T/other: dims 9 layers" "$T/mis.err"; then
    ok "coordinator refuses another model's history: $(grep -o 'usage history.*' "$T/mis.err" | head -1)"
else
    bad "mismatched history not refused by the coordinator (rc $rc): $(tail -1 "$T/mis.err")"
fi
"$W" --model "$T/model" --layers 0-4 --listen "ipc://$T/w0" --no-bench --usage "$T/other" \
    >"$T/w.out" 2>"$T/w.err"
rc=$?
if [ $rc -eq 1 ] && grep -q "usage history $T/other: dims" "$T/w.err"; then
    ok "k3-worker refuses another model's history at start (exit 1)"
else
    bad "k3-worker with a mismatched history: rc $rc, $(tail -1 "$T/w.err")"
fi
exit $fail
