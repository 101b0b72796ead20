#!/usr/bin/env bash
# tests/bench/bench-ab.sh: one kernel of two revisions side by side (issue
# 7). Builds the library of each revision into a shared object (a detached
# git worktree of REV, or the working tree for "."), then runs
# tests/bench/ab_kernels.c, which alternates their calls in one process.
# Prints A/B per round: > 1 means B is faster. K3_ISA picks both levels.
# Usage: tests/bench/bench-ab.sh REV_A REV_B KERNEL N [ROUNDS [THREADS [COPIES]]]
#   e.g. tests/bench/bench-ab.sh 52c3c6c . int4 1 40
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -lt 4 ]; then
    sed -n 2,8p "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
top=$PWD
tmp=$(mktemp -d)
worktrees=()
cleanup() {
    for w in "${worktrees[@]}"; do git -C "$top" worktree remove --force "$w" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT
pkgs=$(sed -n 's/^PKGS *:= *//p' Makefile)
# the Makefile's code-generation flags, position-independent, references bound inside each object
flags="-O2 -std=c11 -D_GNU_SOURCE -pthread -ffp-contract=off -fno-strict-aliasing -fPIC -shared -Wl,-Bsymbolic"
build_so() { # REV NAME -> $tmp/NAME.so
    local src=$top
    if [ "$1" != . ]; then
        src=$tmp/wt-$2
        git worktree add --detach -q "$src" "$1"
        worktrees+=("$src")
    fi
    # Revisions before the common/ folders (2026-12) keep every file in common/.
    local srcs
    srcs=$(ls "$src"/common/*.c "$src"/common/*/*.c 2>/dev/null || true)
    # shellcheck disable=SC2046,SC2086
    ${CC:-cc} $flags -I"$src" $(pkg-config --cflags $pkgs) $srcs "$src"/proto/*.c \
        -o "$tmp/$2.so" $(pkg-config --libs $pkgs) -lm
}
build_so "$1" a
build_so "$2" b
# shellcheck disable=SC2046
${CC:-cc} -O2 -std=c11 -D_GNU_SOURCE -I. $(pkg-config --cflags libzmq) tests/bench/ab_kernels.c \
    -o "$tmp/ab_kernels" -ldl
echo "# A = $1, B = $2, isa ${K3_ISA:-auto}"
"$tmp/ab_kernels" "$tmp/a.so" "$tmp/b.so" "${@:3}"
