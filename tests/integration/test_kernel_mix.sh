#!/usr/bin/env bash
# tests/integration/test_kernel_mix.sh: the profile tools of issue 7 still
# read what they claim to. tests/bench/pipe_probe runs every probe (rates
# are this CPU's, so only their presence is checked), and
# tests/bench/kernel_mix.py --check finds each AVX-512 n = 1 tile's hot loop
# in the built object with the instruction count the kernel was designed
# with (24 vpdpbusd per int4 float step, 32 per 16-row integer step ...): a
# compiler or kernel change that reshapes a loop fails here, not silently in
# the profile's numbers.
set -u
. "$(dirname "$0")/../lib.sh"
OBJ=$BUILD/common/kernels/kernels_avx512.o
[ -f "$OBJ" ] || { echo "not ok - $OBJ not built"; exit 1; }
command -v objdump >/dev/null || {
    skip "pipe_probe and kernel_mix --check" "no objdump (binutils)"
    exit 0
}
make_tmp k3mix

if make --no-print-directory -s BUILD="$BUILD" "$BUILD/bench/pipe_probe" >"$T/make.log" 2>&1; then
    ok "pipe_probe builds"
else
    bad "pipe_probe does not build: $(tail -n 3 "$T/make.log")"
fi
if "$BUILD/bench/pipe_probe" 200000 >"$T/probe.out" 2>&1; then
    if grep -q 'needs AVX-512' "$T/probe.out"; then
        ok "pipe_probe says why it has nothing to probe: $(head -n 1 "$T/probe.out")"
    else
        rows=$(grep -cE '^(vp|vf|vm|vc)[a-z0-9]+ .*[0-9]' "$T/probe.out")
        if [ "$rows" -eq 25 ]; then
            ok "pipe_probe prints its 25 probes"
        else
            bad "pipe_probe printed $rows probe rows, expected 25: $(cat "$T/probe.out")"
        fi
    fi
else
    bad "pipe_probe exited non-zero: $(tail -n 3 "$T/probe.out")"
fi
"$BUILD/bench/pipe_probe" 5 >"$T/bad.out" 2>&1
rc=$?
if [ $rc -eq 2 ] && grep -q 'ITERS 5' "$T/bad.out"; then
    ok "pipe_probe refuses ITERS 5 and names it"
else
    bad "pipe_probe 5: exit $rc: $(cat "$T/bad.out")"
fi

# The profile is of the optimized object: a sanitizer build (-O1, other
# inlining) has other loops.
if nm "$OBJ" 2>/dev/null | grep -qE '__(asan|ubsan|tsan)_'; then
    skip "kernel_mix --check" "$OBJ is a sanitizer build, the profile reads the release one"
else
    /usr/bin/python3 tests/bench/kernel_mix.py --check "$OBJ" || fail=1
fi
exit "$fail"
