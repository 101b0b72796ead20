# tests/lib.sh: what the integration scripts (tests/integration/*.sh) share.
# Sourced, not run (tests/run.sh runs every file in tests/integration/, so
# this one lives outside it):
#     . "$(dirname "$0")/../lib.sh"
# Sets BUILD, TINY, C (k3-coordinator), W (k3-worker), fail=0 and PIDS=(),
# and defines:
#   ok MSG / bad MSG     print "ok - MSG" / "not ok - MSG" (bad sets fail=1)
#   skip WHAT REASON     print "skip - WHAT: skipped: REASON": checks that did
#                        not run, counted by tests/run.sh as skipped, not passed
#   need_bins BIN...     "not ok - BIN not built" and exit 1 unless each runs
#   need_root WHAT       unless root: "skip - WHAT: skipped: needs root", exit 0
#   need_strace WHAT     unless strace and ptrace work: a skip line for WHAT,
#                        exit 0; turns off LeakSanitizer, which cannot run
#                        under ptrace
#   make_tmp NAME        T = a new temporary directory; on exit k3_cleanup
#                        stops every pid in PIDS and removes T (a script with
#                        more to undo sets its own EXIT trap calling it)
#   port                 a free tcp port on 127.0.0.1
#   wait_line FILE RE PID [S]  wait until FILE has a line matching the grep
#                        RE (0), PID exits (1) or S seconds pass (1; 300)
#   identity_runs SEED N NGEN [USAGE]  IDS = N random prompt ids below 1280
#                        (tiny's vocabulary; python's random.Random(SEED)), and
#                        for bit-identity checks:
#                          run NAME ARGS...  $C --model $TINY --ids $IDS --ngen NGEN
#                            --print-ids --threads 1 --usage USAGE ARGS: logits in
#                            $T/NAME.f32, the ids line in $T/NAME.ids, stdout and
#                            stderr in $T/NAME.out / .err; returns its status.
#                            USAGE is off when not given; `default` gives no
#                            --usage (the default history in the cache directory)
#                          same A B  runs A and B gave the same logits and ids (some)
# and exports TSAN_OPTIONS (tests/tsan_env.sh) for a script run alone.

. "$(dirname "${BASH_SOURCE[0]}")/tsan_env.sh"
BUILD=${BUILD:-build}
TINY=${TINY:-$BUILD/fixtures/tiny}
C=$BUILD/k3-coordinator
W=$BUILD/k3-worker
fail=0
PIDS=()
T=""

ok() { echo "ok - $*"; }
skip() { # what reason
    echo "skip - $1: skipped: $2"
}
bad() {
    echo "not ok - $*"
    fail=1
}

need_bins() { # bin...
    local b
    for b in "$@"; do
        [ -x "$b" ] || {
            echo "not ok - $b not built"
            exit 1
        }
    done
}

need_root() { # what
    if [ "$(id -u)" -ne 0 ]; then
        skip "$1" "needs root"
        exit 0
    fi
}

need_strace() { # what
    if ! command -v strace >/dev/null 2>&1; then
        skip "$1" "no strace (make deps installs it)"
        exit 0
    fi
    if ! strace -o /dev/null /bin/true 2>/dev/null; then
        skip "$1" "ptrace not permitted here"
        exit 0
    fi
    # LeakSanitizer stops with "LeakSanitizer has encountered a fatal error"
    # under ptrace, so sanitized builds trace without leak checking; the
    # leak checks run in every other test.
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
}

k3_cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    wait 2>/dev/null
    [ -n "$T" ] && rm -rf "$T"
}

make_tmp() { # name
    T=$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX")
    trap k3_cleanup EXIT
}

serve_start() { # OUT ERR ARGS...: "$C serve ARGS" in the background (pid in SRV, in
    # PIDS), then waits up to 60 s for its "serving on" line; 1 when it did not come
    "$C" serve "${@:3}" >"$1" 2>"$2" &
    SRV=$!
    PIDS+=("$SRV")
    for _ in $(seq 1 600); do
        grep -q "^serving on" "$1" && return 0
        kill -0 "$SRV" 2>/dev/null || break
        sleep 0.1
    done
    grep -q "^serving on" "$1"
}

port() {
    /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

wait_line() { # file re pid [seconds]
    local i
    for ((i = 0; i < ${4:-300} * 10; i++)); do
        grep -q -- "$2" "$1" 2>/dev/null && return 0
        kill -0 "$3" 2>/dev/null || break
        sleep 0.1
    done
    grep -q -- "$2" "$1" 2>/dev/null
}

identity_runs() { # SEED N NGEN [USAGE]
    IDS=$(/usr/bin/python3 -c "import random; r=random.Random($1); print(','.join(str(r.randrange(1280)) for _ in range($2)))")
    IDENTITY_NGEN=$3
    IDENTITY_USAGE=${4:-off}
    [ "$IDENTITY_USAGE" = default ] && IDENTITY_USAGE=""
    run() { # name args...
        local name=$1
        shift
        "$C" --model "$TINY" --ids "$IDS" --ngen "$IDENTITY_NGEN" --print-ids --threads 1 \
            ${IDENTITY_USAGE:+--usage "$IDENTITY_USAGE"} --all-logits "$T/$name.f32" "$@" \
            >"$T/$name.out" 2>"$T/$name.err"
        local rc=$?
        grep '^ids:' "$T/$name.out" >"$T/$name.ids"
        return $rc
    }
    same() { # a b
        cmp -s "$T/$1.f32" "$T/$2.f32" && cmp -s "$T/$1.ids" "$T/$2.ids" && [ -s "$T/$1.ids" ]
    }
}
