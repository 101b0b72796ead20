#!/usr/bin/env bash
# tests/integration/test_split.sh: byte-split expert striping (placement
# version 2, docs/CLUSTER.md "Expert striping", common/experts/placement.h)
# on tiny:
#  - `k3-coordinator place --split --copy` over 2 drives (cut on 4096) and
#    3 drives (weights 2,1,1, cut on 64 so every tiny expert of 1632 bytes
#    is cut): sparse files of the shard's size, each drive's share of the
#    expert bytes by its weight, a rerun keeps every file;
#  - logits and ids bit-identical to --local 0 (unstriped) in process and
#    on 2 and 3 local workers, chunk 32 and 1; `--local 2 --stripe --split
#    --dirs` (3 drives, hard links) too;
#  - refusals at start, naming the thing: a missing piece file, a piece file
#    of the wrong size, --split without --stripe or with --stripe-remote, a
#    worker serving some drives (--stripe-drives) of a split placement,
#    repack --placement with a split placement.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp split-test
export K3_LOG=warn

identity_runs 17 29 5 # IDS, run NAME ARGS..., same A B (tests/lib.sh)
share() { # place.err drive: the drive's percentage of the expert bytes
    sed -n "s/^place: drive $2 .*GB, \([0-9.]*\)% of the expert bytes.*/\1/p" "$1"
}

# ---- place --split ----------------------------------------------------------
if "$C" place --model "$TINY" --drives "$T/a0,$T/a1" --split --copy --usage off \
    --out "$T/s2.json" 2>"$T/p2.err" && grep -q '"version":2' "$T/s2.json" &&
    grep -q '"split":true' "$T/s2.json" && ! grep -q '"layers"' "$T/s2.json"; then
    ok "place --split over 2 drives: a version 2 placement without expert lists ($(tail -1 "$T/p2.err" | cut -c1-60))"
else
    bad "place --split over 2 drives: $(tail -2 "$T/p2.err")"
fi
if "$C" place --model "$TINY" --drives "$T/b0,$T/b1,$T/b2" --weights 2,1,1 --split --align 64 \
    --copy --usage off --out "$T/s3.json" 2>"$T/p3.err"; then
    s0=$(share "$T/p3.err" 0) s1=$(share "$T/p3.err" 1) s2=$(share "$T/p3.err" 2)
    if /usr/bin/python3 -c 'import sys; a,b,c=map(float,sys.argv[1:]); sys.exit(not (45<a<55 and 20<b<30 and 20<c<30))' "$s0" "$s1" "$s2"; then
        ok "place --split --weights 2,1,1 --align 64: each drive holds its weight's share of the expert bytes ($s0% / $s1% / $s2%)"
    else
        bad "--weights 2,1,1 shares: $s0 / $s1 / $s2"
    fi
else
    bad "place --split over 3 drives: $(tail -2 "$T/p3.err")"
fi
sparse=$(/usr/bin/python3 - "$TINY" "$T" <<'EOF'
import os, sys
tiny, t = sys.argv[1], sys.argv[2]
ok, n = 1, 0
for d in ("b0", "b1", "b2"):
    sd = os.path.join(t, d, "k3-stripe")
    for f in os.listdir(sd):
        if not f.endswith(".safetensors"):
            continue
        n += 1
        st = os.stat(os.path.join(sd, f))
        ok &= st.st_size == os.path.getsize(os.path.join(tiny, f))
        ok &= st.st_blocks * 512 < st.st_size * 0.8 or st.st_size < 1 << 16
print(ok if n else 0)
EOF
)
[ "$sparse" = 1 ] && ok "split drive files have the shard's size and are sparse" ||
    bad "split drive files: sizes or sparseness wrong"
"$C" place --model "$TINY" --drives "$T/b0,$T/b1,$T/b2" --weights 2,1,1 --split --align 64 \
    --copy --usage off --out "$T/s3b.json" 2>"$T/p3b.err"
grep -q '(0 B) copied' "$T/p3b.err" && cmp -s "$T/s3.json" "$T/s3b.json" &&
    ok "a rerun keeps every complete split file and writes the same placement" ||
    bad "split rerun: $(tail -1 "$T/p3b.err")"

# ---- bit identity -------------------------------------------------------------
run ref --local 0 --chunk 32 || bad "--local 0: $(tail -1 "$T/ref.err")"
for chunk in 32 1; do
    for cfg in "0 s2" "0 s3" "2 s2" "3 s3"; do
        set -- $cfg
        if run "x$1$2$chunk" --local $1 --chunk $chunk --placement "$T/$2.json" &&
            same "x$1$2$chunk" ref; then
            ok "--local $1 --chunk $chunk split over ${2#s} drives: logits and ids identical to --local 0"
        else
            bad "--local $1 --chunk $chunk split over ${2#s} drives differs or failed: $(tail -1 "$T/x$1$2$chunk.err")"
        fi
    done
done
if run st2 --local 2 --chunk 32 --stripe --split --dirs "$T/e0,$T/e1,$T/e2" && same st2 ref &&
    grep -q '"split":true' "$T/e0/k3-stripe/placement.json"; then
    ok "--local 2 --stripe --split --dirs (3 drives, hard links): identical to --local 0"
else
    bad "--local 2 --stripe --split: $(tail -2 "$T/st2.err")"
fi

# ---- refusals ------------------------------------------------------------------
f=$(ls "$T/b1/k3-stripe/"*.safetensors | sed -n 2p)
mv "$f" "$f.keep"
run missing --local 0 --placement "$T/s3.json"
grep -q "has a piece on drive 1, but its file $f cannot be opened" "$T/missing.err" &&
    ok "a missing piece file is refused at start naming it: $(grep -o 'layer [0-9]* expert [0-9]* has a piece on drive 1' "$T/missing.err")" ||
    bad "missing piece file: $(tail -2 "$T/missing.err")"
mv "$f.keep" "$f"
truncate -s -1 "$f"
run short --local 2 --placement "$T/s3.json"
grep -q "$f is [0-9]* bytes, the checkpoint's .* is [0-9]*" "$T/short.err" &&
    ok "a piece file of the wrong size is refused at start naming it" ||
    bad "short piece file: $(tail -2 "$T/short.err")"
truncate -s +1 "$f"
"$C" --model "$TINY" --ids 1,2 --split 2>"$T/nostripe.err"
[ $? = 2 ] && grep -q -- '--split goes with --stripe' "$T/nostripe.err" &&
    ok "--split without --stripe is a usage error" || bad "--split alone: $(cat "$T/nostripe.err")"
"$C" --model "$TINY" --ids 1,2 --local 2 --stripe-remote --split --dirs "$T/e0,$T/e1" 2>"$T/remote.err"
[ $? = 2 ] && grep -q -- 'not --stripe-remote' "$T/remote.err" &&
    ok "--split with --stripe-remote is a usage error" || bad "--split --stripe-remote: $(cat "$T/remote.err")"
timeout 60 "$W" --model "$TINY" --layers 0-8 --listen "ipc://$T/w.sock" --placement "$T/s2.json" \
    --stripe-drives 0 --expert-listen "ipc://$T/x.sock" --stripe-peers "1=ipc://$T/y.sock" \
    --insecure --no-bench --usage off 2>"$T/xs.err"
rc=$?
[ $rc != 0 ] && [ $rc != 124 ] && grep -q "s2.json is byte-split .*: serving some of its drives to other workers needs an expert-grained placement" "$T/xs.err" &&
    ok "a worker serving some drives of a split placement is refused at start naming it" ||
    bad "--stripe-drives with a split placement (exit $rc): $(tail -2 "$T/xs.err")"
"$C" repack "$TINY" "$T/rp" --placement "$T/s3.json" 2>"$T/repack.err"
grep -q 'is byte-split (placement version 2): repack writes whole experts' "$T/repack.err" &&
    ok "repack --placement with a split placement is refused naming it" ||
    bad "repack with a split placement: $(tail -2 "$T/repack.err")"
exit $fail
