#!/usr/bin/env bash
# tests/bench/bench-layers.sh: builds tests/bench/bench_layers.c with the
# Makefile's own compiler and flags against $BUILD/libk3.a and runs it
# (`make bench-layers`): one KDA and one MLA layer at the real K3 shapes.
# Prints a table; not a timed test. Extra arguments go to the program
# (--threads N, --quick, --only kda|mla). K3_ISA picks the level.
set -euo pipefail
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
# Ask make for CC/CFLAGS/LDLIBS so the benchmark never drifts from the build.
vars() {
    make --no-print-directory -s -f Makefile -f - BUILD="$BUILD" _k3_bench_vars <<'MK'
_k3_bench_vars:
	@echo '$(CC)'; echo '$(CFLAGS)'; echo '$(LDLIBS)'
MK
}
mapfile -t V < <(vars)
CC_=${V[0]} CFLAGS_=${V[1]} LDLIBS_=${V[2]}
[ -f "$BUILD/libk3.a" ] || make --no-print-directory "$BUILD/libk3.a"
mkdir -p "$BUILD/bench"
# shellcheck disable=SC2086
$CC_ $CFLAGS_ -o "$BUILD/bench/bench_layers" tests/bench/bench_layers.c "$BUILD/libk3.a" $LDLIBS_
exec "$BUILD/bench/bench_layers" "$@"
