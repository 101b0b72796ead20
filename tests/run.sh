#!/usr/bin/env bash
# tests/run.sh: runs every test program ($BUILD/tests/test_*) and every
# integration script (tests/integration/*.sh, *.py), each under a timeout,
# logs to $BUILD/test-logs/, counts "ok - ", "not ok - " and "skip - " lines
# (passed, failed, skipped: a skip is "skip - WHAT: skipped: REASON", from
# SKIP in tests/test.h or skip in tests/lib.sh) and prints the final
# "N passed, N failed, N skipped". A program that exits non-zero without a
# "not ok" line (a crash, a timeout) counts as one failure, and so does one
# that prints none of the three lines (it checked nothing). TESTS="pat ..."
# runs only the programs whose name contains one of the patterns.
set -u
. "$(dirname "$0")/tsan_env.sh"

selected() { # name: 0 when TESTS is empty or one of its words is in name
    [ -z "${TESTS:-}" ] && return 0
    local w
    for w in $TESTS; do [[ "$1" == *"$w"* ]] && return 0; done
    return 1
}
BUILD=${BUILD:-build}
export BUILD TINY=${TINY:-$BUILD/fixtures/tiny}
LOGS=$BUILD/test-logs
mkdir -p "$LOGS"
# k3shard's default cache (expert usage history, plan's compute measurement)
# goes to this run's own directory, never the user's ~/.cache (common/base/
# cache_dir.h); a script that tests the XDG_CACHE_HOME path unsets it
rm -rf "$LOGS/cache"
mkdir -p "$LOGS/cache"
K3_CACHE_DIR=$(cd "$LOGS/cache" && pwd)
export K3_CACHE_DIR
PER_TEST_TIMEOUT=${PER_TEST_TIMEOUT:-900}
pass=0 fail=0 skip=0
failed_names=()

run_one() {  # name, command...
    local name=$1; shift
    local log=$LOGS/$name.log
    local t0=$(date +%s.%N)
    timeout -k 10 "$PER_TEST_TIMEOUT" "$@" >"$log" 2>&1
    local rc=$?
    local p f s
    p=$(grep -c '^ok - ' "$log")
    f=$(grep -c '^not ok - ' "$log")
    s=$(grep -c '^skip - ' "$log")
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        f=1
        echo "not ok - $name exited with status $rc (see $log)" >>"$log"
    elif [ $((p + f + s)) -eq 0 ]; then
        f=1
        echo "not ok - $name ran no checks: no ok, not ok or skip line (see $log)" >>"$log"
    fi
    local dt=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}")
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
    if [ "$f" -eq 0 ]; then
        printf 'PASS %-32s %4d checks, %d skipped  %6ss\n' "$name" "$p" "$s" "$dt"
        grep '^skip - ' "$log" | head -n 5 | sed 's/^/     /'
    else
        printf 'FAIL %-32s %4d ok, %d failed, %d skipped  %6ss\n' "$name" "$p" "$f" "$s" "$dt"
        grep '^not ok - ' "$log" | head -n 20 | sed 's/^/     /'
        tail -n 15 "$log" | sed 's/^/     | /'
        failed_names+=("$name")
    fi
}

for t in "$BUILD"/tests/test_*; do
    [ -x "$t" ] || continue
    n=$(basename "$t")
    selected "$n" || continue
    run_one "$n" "$t"
done
for s in tests/integration/*.sh tests/integration/*.py; do
    [ -f "$s" ] || continue
    n=$(basename "$s")
    selected "$n" || continue
    case "$s" in
        *.sh) run_one "$n" bash "$s" ;;
        *.py) run_one "$n" /usr/bin/python3 "$s" ;;
    esac
done

[ ${#failed_names[@]} -gt 0 ] && echo "failed: ${failed_names[*]}"
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
