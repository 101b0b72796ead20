#!/usr/bin/env bash
# tests/bench/bench-vk.sh: builds tests/bench/bench_vk.c with the Makefile's
# compiler and flags and runs it (`make bench-vk`): one MXFP4 expert's time
# on the Vulkan device (lavapipe here) against the CPU exact-float kernel,
# paired round by round. Prints a table; not a timed test. Extra arguments
# go to the program (--quick: K3 width only at n = 1, fewer rounds).
set -euo pipefail
BUILD=${BUILD:-build}
cd "$(dirname "$0")/../.."
make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench/bench_vk"
"$BUILD/bench/bench_vk" "$@"
