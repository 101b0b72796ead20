# tests/tsan_env.sh: the ThreadSanitizer run-time options of every test,
# in one place. Sourced by tests/run.sh (test programs) and tests/lib.sh
# (integration scripts run alone); exported, so the k3-worker processes the
# tests start inherit them. Builds without TSan ignore the variable.
#   suppressions   tests/tsan.supp (absolute: workers run from anywhere)
#   halt_on_error=0, exitcode=66
#                  every report of a run is printed, and a process that
#                  printed one exits 66, which fails its test
#   second_deadlock_stack=1
#                  lock-order reports show both acquisitions
# A TSAN_OPTIONS already set is kept; the suppressions are added to it
# unless it names its own.
_k3_supp="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/tsan.supp"
case "${TSAN_OPTIONS:-}" in
*suppressions=*) ;;
*) TSAN_OPTIONS="suppressions=$_k3_supp halt_on_error=0 exitcode=66 second_deadlock_stack=1${TSAN_OPTIONS:+ $TSAN_OPTIONS}" ;;
esac
export TSAN_OPTIONS
# LeakSanitizer (make asan): tests/lsan.supp names the leaks of libraries we
# call (libedit's wide-character strings), never one of k3shard's own.
_k3_lsupp="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lsan.supp"
case "${LSAN_OPTIONS:-}" in
*suppressions=*) ;;
*) LSAN_OPTIONS="suppressions=$_k3_lsupp${LSAN_OPTIONS:+:$LSAN_OPTIONS}" ;;
esac
export LSAN_OPTIONS
unset _k3_supp _k3_lsupp
