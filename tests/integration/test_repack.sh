#!/usr/bin/env bash
# tests/integration/test_repack.sh: `k3-coordinator repack` and the engine's
# container paths (docs/DEPLOY.md "Workstation", docs/MODEL.md 2.3).
#  - int8 and int4 containers give logits bit-identical to the source run at
#    the same bits, in-process and with --mmap;
#  - K3_BITS=4 on an int4 container changes nothing; on an int8 container it
#    downcasts (different bits from int8, argmax of a direct int4 run), and
#    --mmap refuses the downcast naming the tensor;
#  - a repack killed (SIGKILL) in the middle of a shard and re-run gives a
#    byte-identical container; disjoint --shards runs give the index of one
#    run; --verify-full finds one corrupted expert byte;
#  - a container with a wrong-shape tensor or a missing .qs is refused at
#    load naming the tensor;
#  - repack --placement PLAN.json --copy stripes the new container over the
#    plan's 2 drives by their shares (sparse copies) in the conversion
#    stream (no second read: the closing layout copies nothing, and each
#    drive file equals a second-pass place --copy's), and a run with that
#    placement gives the plain container's logits; another model's plan is
#    refused before the conversion.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C"
make_tmp workstation_repack
. "$(dirname "$0")/../workstation_lib.sh"
export K3_USAGE=off K3_LOG=warn
IDS=5,7,9,11,13,17,19,23
PY=/usr/bin/python3

# logits of every prompt position and 2 generated tokens, in-process
logits() { # out model [args...]
    local out=$1
    shift
    "$C" --model "$@" --local 0 --ids "$IDS" --ngen 2 --all-logits "$out" >/dev/null 2>"$out.err"
}
same() { cmp -s "$1" "$2"; }

# 1. int8 and int4 containers against the source
for b in 8 4; do
    if ! "$C" repack "$TINY" "$T/c$b" --bits "$b" --quiet 2>"$T/r$b.err"; then
        bad "repack --bits $b: $(tail -1 "$T/r$b.err")"
        continue
    fi
    logits "$T/src$b" "$TINY" --bits "$b" || bad "source run --bits $b: $(tail -1 "$T/src$b.err")"
    logits "$T/ct$b" "$T/c$b" || bad "container run: $(tail -1 "$T/ct$b.err")"
    logits "$T/mm$b" "$T/c$b" --mmap || bad "container --mmap run: $(tail -1 "$T/mm$b.err")"
    if same "$T/src$b" "$T/ct$b" && [ -s "$T/ct$b" ]; then
        ok "int$b container: logits bit-identical to the source at --bits $b"
    else
        bad "int$b container: logits differ from the source at --bits $b"
    fi
    if same "$T/src$b" "$T/mm$b" && [ -s "$T/mm$b" ]; then
        ok "int$b container with --mmap: the same bits"
    else
        bad "int$b container with --mmap: logits differ"
    fi
done
# the source cannot be mapped: its matrices need load-time quantization
if "$C" --model "$TINY" --mmap --local 0 --ids "$IDS" --ngen 1 >/dev/null 2>"$T/mmsrc.err"; then
    bad "--mmap on the BF16 source was accepted"
elif grep -q "K3_MMAP=1: tensor .* is not prepared" "$T/mmsrc.err"; then
    ok "--mmap on the source refused naming the tensor: $(grep -o 'tensor [^ ]*' "$T/mmsrc.err" | head -1)"
else
    bad "--mmap on the source: unexpected message: $(tail -1 "$T/mmsrc.err")"
fi

# 2. K3_BITS=4 on containers
logits "$T/i4x" "$T/c4" --bits 4
if same "$T/i4x" "$T/src4"; then
    ok "--bits 4 on an int4 container: the same bits as a direct int4 run"
else
    bad "--bits 4 on an int4 container changed the logits"
fi
logits "$T/dc" "$T/c8" --bits 4
if [ -s "$T/dc" ] && ! same "$T/dc" "$T/ct8" && ! same "$T/dc" "$T/src4"; then
    agree=$($PY - "$T/dc" "$T/src4" "$TINY" <<'PY'
import struct, sys
a = open(sys.argv[1], "rb").read(); b = open(sys.argv[2], "rb").read()
n = len(a) // 4
x = struct.unpack("%df" % n, a); y = struct.unpack("%df" % n, b)
import json
V = json.load(open(sys.argv[3] + "/config.json"))["text_config"]["vocab_size"]
T = n // V
am = lambda v, t: max(range(V), key=lambda i: v[t * V + i])
print(sum(am(x, t) == am(y, t) for t in range(T)), T)
PY
)
    set -- $agree
    if [ "$1" -ge $(($2 - 1)) ]; then
        ok "--bits 4 on an int8 container downcasts (bits differ from int8 and from direct int4), argmax agrees with direct int4 at $1/$2 positions"
    else
        bad "--bits 4 on an int8 container: argmax agrees with direct int4 at only $1/$2 positions"
    fi
else
    bad "--bits 4 on an int8 container: no downcast seen ($(tail -1 "$T/dc.err"))"
fi
if logits "$T/dcm" "$T/c8" --bits 4 --mmap; then
    bad "--mmap with a downcast was accepted"
elif grep -q "K3_MMAP=1: tensor .* downcast" "$T/dcm.err"; then
    ok "--mmap refuses the downcast naming the tensor"
else
    bad "--mmap downcast: unexpected message: $(tail -1 "$T/dcm.err")"
fi

# 3. kill -9 in the middle of a shard, then resume: byte-identical
rc=$( { K3_REPACK_TEST_KILL_AT=300000 "$C" repack "$TINY" "$T/k8" --bits 8 --quiet; } 2>/dev/null
    echo $?)
ntmp=$(ls "$T/k8" 2>/dev/null | grep -c '\.tmp$')
if [ "$rc" -eq 137 ] && [ "$ntmp" -ge 1 ]; then
    ok "repack killed by SIGKILL mid-shard (rc 137, $ntmp .tmp file left, $(ls "$T/k8" | grep -c 'safetensors$') shards complete)"
else
    bad "the kill hook did not stop repack mid-shard (rc $rc, $ntmp .tmp files)"
fi
"$C" repack "$TINY" "$T/k8" --bits 8 2>"$T/k8.err" || bad "resume: $(tail -1 "$T/k8.err")"
rm -f "$T/k8"/*.tmp # a later run would overwrite it; not part of the container
if diff -r "$T/k8" "$T/c8" >/dev/null; then
    ok "resumed repack is byte-identical to an uninterrupted one ($(grep -o '[0-9]* already complete' "$T/k8.err"))"
else
    bad "resumed repack differs: $(diff -rq "$T/k8" "$T/c8" | head -2)"
fi

# a resumed run with other bits would mix formats: refused
if "$C" repack "$TINY" "$T/c8" --bits 4 --quiet 2>"$T/mix.err"; then
    bad "repack --bits 4 into an int8 container was accepted"
elif grep -q 'was started with --bits 8' "$T/mix.err"; then
    ok "repack --bits 4 into an int8 container refused: $(sed 's/^repack: //' "$T/mix.err" | cut -c1-100)"
else
    bad "repack --bits 4 into an int8 container: unexpected message: $(tail -1 "$T/mix.err")"
fi

# 4. disjoint --shards runs give the index of one run
"$C" repack "$TINY" "$T/s8" --bits 8 --shards 1,2,3 --quiet 2>/dev/null
n1=$($PY -c 'import json,sys; print(len(set(json.load(open(sys.argv[1]))["weight_map"].values())))' "$T/s8/model.safetensors.index.json")
"$C" repack "$TINY" "$T/s8" --bits 8 --shards 4,5,6,7,8,9 --quiet 2>/dev/null
if [ "$n1" = 3 ] && cmp -s "$T/s8/model.safetensors.index.json" "$T/c8/model.safetensors.index.json"; then
    ok "--shards 1,2,3 then 4..9: the index of one run (after the first: $n1 shards indexed)"
else
    bad "disjoint --shards: index differs from one run (first pass indexed $n1 shards)"
fi

# 5. --verify-full passes on a good container, finds one flipped expert byte
if "$C" repack "$TINY" "$T/c8" --bits 8 --verify-full 2>"$T/v.err" &&
    grep -q 'expert tensors identical' "$T/v.err"; then
    ok "--verify-full on a good container: $(grep -o '[0-9]* expert tensors identical' "$T/v.err")"
else
    bad "--verify-full on a good container failed: $(tail -1 "$T/v.err")"
fi
cp -r "$T/c8" "$T/bad"
name=$($PY - "$T/bad" <<'PY'
import json, struct, sys
d = sys.argv[1]
wm = json.load(open(d + "/model.safetensors.index.json"))["weight_map"]
name = sorted(k for k in wm if ".experts.3.w2.weight_packed" in k)[0]
path = d + "/" + wm[name]
f = open(path, "r+b"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n))
off = 8 + n + h[name]["data_offsets"][0] + 17
f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ 0x10])); f.close()
print(name)
PY
)
if "$C" repack "$TINY" "$T/bad" --bits 8 --verify-full --quiet 2>"$T/vb.err"; then
    bad "--verify-full missed a corrupted byte of $name"
elif grep -q "VERIFY FAILED: $name" "$T/vb.err"; then
    ok "--verify-full finds the corrupted byte: $(grep -o 'VERIFY FAILED: [^ ]*' "$T/vb.err")"
else
    bad "--verify-full: unexpected message: $(tail -1 "$T/vb.err")"
fi

# 6. broken containers are refused at load, naming the tensor
for mode in swap noqs; do
    rm -rf "$T/b_$mode"
    cp -r "$T/c8" "$T/b_$mode"
    name=$(ws_edit_header "$T/b_$mode" $mode)
    # the index is rebuilt from the edited shards (no shard is rewritten)
    "$C" repack "$TINY" "$T/b_$mode" --bits 8 --quiet 2>/dev/null
    if logits "$T/o_$mode" "$T/b_$mode"; then
        bad "container with $mode on $name was accepted"
    elif grep -q "$name" "$T/o_$mode.err"; then
        ok "container with $mode refused at load naming the tensor: $(grep -o 'error: .*' "$T/o_$mode.err" | cut -c1-150)"
    else
        bad "container with $mode: message does not name $name: $(tail -1 "$T/o_$mode.err")"
    fi
done

# 7. repack --placement: the conversion also lays out the stripes
cat >"$T/plan.json" <<EOF
{"format": "k3shard-plan", "version": 1,
 "drives": [{"path": "$T/pd0", "share": 0.75}, {"path": "$T/pd1", "share": 0.25}]}
EOF
if "$C" repack "$TINY" "$T/pc8" --bits 8 --placement "$T/plan.json" --copy 2>"$T/pl.err" &&
    [ -s "$T/pd0/k3-stripe/placement.json" ]; then
    e0=$(grep -o 'drive 0 [^:]*: [0-9]* experts' "$T/pl.err" | grep -o '[0-9]* experts')
    e1=$(grep -o 'drive 1 [^:]*: [0-9]* experts' "$T/pl.err" | grep -o '[0-9]* experts')
    ok "repack --placement: container and stripes written (drive 0: $e0, drive 1: $e1)"
    [ "${e0% *}" -gt $((2 * ${e1% *})) ] && ok "the 0.75 share holds 3x the experts of the 0.25 one" ||
        bad "shares 0.75/0.25 gave $e0 / $e1"
    # written in the stream: the closing layout found every drive file complete
    # (nothing copied), and each equals what a second pass (place --copy over
    # the plain int8 container $T/c8) writes
    kept=$(grep -o '0.00 GB (0 B) copied, [0-9.]* GB ([0-9]* B) hard-linked, [0-9.]* GB ([0-9]* B) kept' "$T/pl.err")
    "$C" place --model "$T/c8" --drives "$T/qd0,$T/qd1" --weights 0.75,0.25 --copy --usage off \
        --out "$T/q.json" 2>"$T/q.err"
    nf=0 nd=0
    for d in 0 1; do
        for f in "$T/qd$d"/k3-stripe/*.safetensors; do
            nf=$((nf + 1))
            cmp -s "$f" "$T/pd$d/k3-stripe/$(basename "$f")" || nd=$((nd + 1))
        done
    done
    if [ -n "$kept" ] && [ "$(grep -c 'B) copied' "$T/pl.err")" = 1 ] && [ $nf -gt 2 ] && [ $nd = 0 ] &&
        [ "$(ls "$T"/pd[01]/k3-stripe/*.safetensors | wc -l)" = $nf ] &&
        ! ls "$T"/pd[01]/k3-stripe/*.tmp >/dev/null 2>&1; then
        ok "repack --placement wrote the stripes in the stream: the closing layout copied nothing ($(echo "$kept" | cut -d, -f1,3 | cut -c1-80)); $nf drive files byte-identical to a second-pass place --copy"
    else
        bad "stream-written stripes: '$kept', $nd of $nf drive files differ from place --copy: $(grep 'copied' "$T/pl.err" | tail -1)"
    fi
    logits "$T/pl8" "$T/pc8" --placement "$T/pd0/k3-stripe/placement.json" ||
        bad "run with the placement: $(tail -1 "$T/pl8.err")"
    if same "$T/pl8" "$T/ct8" && [ -s "$T/pl8" ]; then
        ok "repacked + placed container: logits bit-identical to the plain container"
    else
        bad "repacked + placed container: logits differ from the plain container"
    fi
else
    bad "repack --placement: $(tail -2 "$T/pl.err")"
fi
sed 's/"version": 1,/"version": 1, "model_fingerprint": "0123456789abcdef",/' "$T/plan.json" >"$T/plan_o.json"
if "$C" repack "$TINY" "$T/po8" --placement "$T/plan_o.json" --quiet 2>"$T/plo.err"; then
    bad "repack --placement with another model's plan was accepted"
elif grep -q 'was made for model 0123456789abcdef' "$T/plo.err" && [ ! -e "$T/po8" ]; then
    ok "another model's plan refused before converting: $(cut -c1-110 "$T/plo.err")"
else
    bad "another model's plan: unexpected: $(tail -1 "$T/plo.err") (or $T/po8 was created)"
fi

exit $fail
