#!/usr/bin/env bash
# tests/bench/bench-layers.sh: builds tests/bench/bench_layers.c with the
# Makefile's own compiler and flags against $BUILD/libk3.a and runs it
# (`make bench-layers`): one KDA and one MLA layer at the real K3 shapes.
# Prints a table; not a timed test. Extra arguments go to the program
# (--threads N, --quick, --only kda|mla). K3_ISA picks the level.
set -euo pipefail
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench/bench_layers"
exec "$BUILD/bench/bench_layers" "$@"
