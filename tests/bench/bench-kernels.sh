#!/usr/bin/env bash
# tests/bench/bench-kernels.sh: builds tests/bench/bench_kernels.c with the
# Makefile's own compiler and flags against $BUILD/libk3.a and runs it
# (`make bench-kernels`). Prints a table; not a timed test. Extra arguments
# go to the program (--quick: shorter measurements). K3_ISA picks the level.
# Then kernel-mix.sh: the pipe probes and the AVX-512 tiles' instruction
# mixes, the profile behind the table where `perf` has no counters.
set -euo pipefail
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench/bench_kernels"
"$BUILD/bench/bench_kernels" "$@"
echo
BUILD="$BUILD" bash tests/bench/kernel-mix.sh
