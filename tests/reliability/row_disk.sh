#!/usr/bin/env bash
# tests/reliability/row_disk.sh: the disk rows of `make reliability`
# (docs/RELIABILITY.md "The table"); run by run.sh, or alone.
#  EIO on an expert read: the routed experts are placed (k3-coordinator
#    place --copy) on a drive of their own, an ext4 file system on a loop
#    device; the device is then shrunk under the mounted file system (the
#    backing file truncated, `losetup -c`), so every expert read past the
#    cut fails in the block layer with EIO, as a dying drive's would (this
#    kernel has no device-mapper, so no dm `error` target). A run must end
#    with a clean error naming the layer, the expert, the shard, the drive
#    and the errno, in bounded time; once the drive's bytes are back, the
#    next run is token-identical.
#  full disk: what the engine writes, on a full file system (a 512 KiB
#    tmpfs): the usage history at the end of a run (a warning naming the
#    path and ENOSPC, the run's ids unchanged, the previous history intact,
#    no <path>.tmp left) and a repack's output (exit 1 naming the shard
#    and ENOSPC, every completed shard whole; after space is freed the same
#    command resumes and the container generates the source's ids) and
#    place's stripe copies on a 256 KiB tmpfs (exit 1 naming the file, the
#    offset and ENOSPC, no placement file written; with room the same
#    command completes and a run on it has the reference ids). The ipc
#    directory of --local (/tmp/k3c.XXXXXX) is not covered: it holds only
#    sockets.
# Prints `ROW|what|trials|recovered|errors|max_rss|max_recovery` lines (the
# format run.sh collects), ok / not ok lines, and exits 1 when a row is not
# as required. Needs root (loop devices, mounts): a ROW saying so otherwise.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
if [ "$(id -u)" -ne 0 ]; then
    echo "ROW|EIO on an expert read (a shrunk loop device under the experts' drive)|-|not run|-|-|- (needs root)"
    echo "ROW|full disk (usage history, repack output)|-|not run|-|-|- (needs root)"
    skip "disk rows" "needs root"
    exit 0
fi
C=$(readlink -f "$C")
TINY=$(readlink -f "$TINY")
make_tmp k3rel_disk
LOOP="" MNTS=()
cleanup() {
    local m
    for m in "${MNTS[@]}"; do umount "$m" 2>/dev/null; done
    [ -n "$LOOP" ] && losetup -d "$LOOP" 2>/dev/null
    k3_cleanup
}
trap cleanup EXIT
export K3_LOG=info K3_LOG_TIME=0
IDS=$(/usr/bin/python3 -c 'import random; r=random.Random(7); print(",".join(str(r.randrange(1280)) for _ in range(24)))')
ms_now() { echo $(($(date +%s%N) / 1000000)); }
peak() { tail -1 "$1" 2>/dev/null | grep -E '^[0-9]+$' || echo 0; }
gen() { # name args...: one run under a 120 s limit, its peak RSS (kB) in $T/name.rss
    local name=$1
    shift
    timeout 120 /usr/bin/time -f '%M' -o "$T/$name.rss" "$C" --model "$TINY" --ids "$IDS" \
        --ngen 8 --threads 1 --print-ids --usage off "$@" >"$T/$name.out" 2>"$T/$name.err"
}
gen ref --local 2
REF=$(grep '^ids:' "$T/ref.out")
[ -n "$REF" ] || bad "reference run failed: $(tail -1 "$T/ref.err")"

# ---- EIO on an expert read ----
img=$T/drive.img
truncate -s 16M "$img" && mkfs.ext4 -q -F -b 1024 "$img" && LOOP=$(losetup -f --show "$img") &&
    mkdir "$T/drive" && mount "$LOOP" "$T/drive" && MNTS+=("$T/drive")
if [ $? -ne 0 ] || [ -z "$LOOP" ]; then
    echo "ROW|EIO on an expert read|-|not run|-|-|- (no loop device or ext4 mount here)"
    skip "EIO row" "cannot mount an ext4 loop device"
else
    "$C" place --model "$TINY" --drives "$T/drive" --copy --usage off --out "$T/placement.json" \
        >"$T/place.out" 2>&1 || bad "place on the loop drive: $(tail -1 "$T/place.out")"
    sync
    gen placed --local 2 --placement "$T/placement.json"
    [ "$(grep '^ids:' "$T/placed.out")" = "$REF" ] ||
        bad "experts on the loop drive: ids differ or the run failed: $(tail -1 "$T/placed.err")"
    # the lowest physical block (1 KiB) of any stripe file: the cut, so that
    # every expert read fails while the file system's metadata stays readable
    cut=$(for f in "$T"/drive/k3-stripe/*.safetensors; do filefrag -v "$f"; done |
        awk '$1 ~ /^[0-9]+:$/ { sub(/\.\./, " ", $4); split($4, p, " "); print p[1] + 0 }' |
        sort -n | head -1)
    cp "$img" "$T/drive.bak"
    # a fresh mount: nothing of the stripe files in the page cache
    umount "$T/drive" && mount -o ro "$LOOP" "$T/drive"
    ok_n=0 err_n=0 n=0 rss=0 worst=0 resumes=0
    if [ -z "$cut" ] || [ "$cut" -lt 64 ]; then
        bad "EIO: no stripe file extents found (cut '$cut')"
    else
        n=1
        truncate -s $((cut * 1024)) "$img" && losetup -c "$LOOP"
        t0=$(ms_now)
        gen eio --local 2 --placement "$T/placement.json"
        rc=$?
        dt=$(($(ms_now) - t0))
        worst=$dt
        rss=$(peak "$T/eio.rss")
        msg=$(grep -m1 'Input/output error' "$T/eio.err")
        resumes=$(grep -c 'step failed.*Input/output error.*resuming' "$T/eio.err")
        echo "# EIO run: rc $rc in $dt ms: $msg"
        if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ -n "$msg" ] &&
            echo "$msg" | grep -q 'layer [0-9]* expert [0-9]* (shard .* on drive .*offset [0-9]*' &&
            grep -q '^k3-coordinator: error: worker .*Input/output error' "$T/eio.err"; then
            err_n=1
            ok "EIO on an expert read: rc $rc in $dt ms, after $resumes resumes the coordinator: $(grep -m1 '^k3-coordinator: error:' "$T/eio.err" | sed "s|$T|T|g" | cut -c1-300)"
        else
            bad "EIO on an expert read: rc $rc in $dt ms, no clean error: $(grep k3-coordinator "$T/eio.err" | tail -2)"
        fi
        # the drive's bytes back: the next run is token-identical
        umount "$T/drive"
        cp "$T/drive.bak" "$img" && losetup -c "$LOOP" && mount -o ro "$LOOP" "$T/drive"
        gen back --local 2 --placement "$T/placement.json"
        if [ "$(grep '^ids:' "$T/back.out")" = "$REF" ]; then
            ok_n=1
            ok "EIO: after the drive is restored the next run is token-identical"
        else
            bad "EIO: the run after the restore: $(tail -1 "$T/back.err")"
        fi
        r=$(peak "$T/back.rss")
        [ "$r" -gt "$rss" ] && rss=$r
    fi
    echo "ROW|EIO on every expert read (experts on a loop-device ext4 drive shrunk under its mount; the run ends, then the drive is restored and the next run retried)|$n|$ok_n (the next run, after the restore)|$err_n (after $resumes replays: worker, layer, expert, shard, drive, offset, errno)|$rss kB|$worst ms to the error"
fi

# ---- full disk ----
mkdir "$T/full" && mount -t tmpfs -o size=512k k3relfull "$T/full" && MNTS+=("$T/full") ||
    bad "cannot mount a tmpfs"
n=0 ok_n=0 err_n=0 rss=0
# 1. the usage history at the end of a run, on a full file system
mkdir -p "$T/full/cache"
export XDG_CACHE_HOME=$T/full/cache
unset K3_USAGE K3_CACHE_DIR # K3_CACHE_DIR (tests/run.sh sets one) would win over XDG_CACHE_HOME
timeout 120 "$C" --model "$TINY" --ids "$IDS" --ngen 8 --threads 1 --print-ids --local 0 \
    >"$T/u0.out" 2>"$T/u0.err" || bad "usage history: first run: $(tail -1 "$T/u0.err")"
hist=$(find "$T/full/cache" -name usage -type f | head -1)
[ -n "$hist" ] && [ -s "$hist" ] || bad "usage history: none written under $T/full/cache"
cp "$hist" "$T/hist.bak" 2>/dev/null
dd if=/dev/zero of="$T/full/filler" bs=4k 2>/dev/null # fills the tmpfs (ENOSPC ends dd)
n=$((n + 1))
timeout 120 /usr/bin/time -f '%M' -o "$T/u1.rss" "$C" --model "$TINY" --ids "$IDS" --ngen 8 \
    --threads 1 --print-ids --local 0 >"$T/u1.out" 2>"$T/u1.err"
rc=$?
rss=$(peak "$T/u1.rss")
msg=$(grep -m1 'No space left on device' "$T/u1.err")
if [ $rc -eq 0 ] && [ "$(grep '^ids:' "$T/u1.out")" = "$REF" ] && cmp -s "$hist" "$T/hist.bak" &&
    ! [ -e "$hist.tmp" ]; then
    ok_n=$((ok_n + 1))
    ok "usage history on a full disk: the run's ids unchanged, the previous history intact, no .tmp left"
else
    bad "usage history on a full disk: rc $rc, ids $(grep -c '^ids:' "$T/u1.out"), history $(cmp -s "$hist" "$T/hist.bak" && echo intact || echo changed), $(tail -1 "$T/u1.err")"
fi
if echo "$msg" | grep -q "usage history $hist.*No space left on device"; then
    err_n=$((err_n + 1))
    ok "usage history on a full disk: named: $(echo "$msg" | cut -c1-160)"
else
    bad "usage history on a full disk: no warning naming the path and ENOSPC: $(grep -i usage "$T/u1.err" | tail -1)"
fi
unset XDG_CACHE_HOME
rm -rf "$T/full/filler" "$T/full/cache"

# 2. a repack's output on a full file system, then resumed with room
n=$((n + 1))
timeout 120 /usr/bin/time -f '%M' -o "$T/r1.rss" "$C" repack "$TINY" "$T/full/out" --quiet \
    >"$T/r1.out" 2>"$T/r1.err"
rc=$?
r=$(peak "$T/r1.rss")
[ "$r" -gt "$rss" ] && rss=$r
msg=$(grep -m1 'No space left on device' "$T/r1.err")
if [ $rc -eq 1 ] && echo "$msg" | grep -q "$T/full/out/model-[0-9-]*of-[0-9]*.safetensors.tmp: write: No space"; then
    err_n=$((err_n + 1))
    ok "repack on a full disk: exit 1, named: $(echo "$msg" | sed "s|$T|T|g")"
else
    bad "repack on a full disk: rc $rc: $(tail -1 "$T/r1.err")"
fi
# every completed shard is whole: a header that parses and a size that matches it
whole=$(/usr/bin/python3 - "$T/full/out" <<'EOF'
import json, os, struct, sys
bad = 0
for f in sorted(os.listdir(sys.argv[1])):
    if not f.endswith('.safetensors'):
        continue
    p = os.path.join(sys.argv[1], f)
    with open(p, 'rb') as h:
        n = struct.unpack('<Q', h.read(8))[0]
        hdr = json.loads(h.read(n))
    end = max(v['data_offsets'][1] for k, v in hdr.items() if k != '__metadata__')
    bad += os.path.getsize(p) != 8 + n + end
print('whole' if bad == 0 else 'broken')
EOF
)
mount -o remount,size=8m "$T/full"
timeout 120 "$C" repack "$TINY" "$T/full/out" --quiet >"$T/r2.out" 2>"$T/r2.err"
rc=$?
gen repacked --local 2 --model "$T/full/out"
if [ "$whole" = whole ] && [ $rc -eq 0 ] && [ "$(grep '^ids:' "$T/repacked.out")" = "$REF" ]; then
    ok_n=$((ok_n + 1))
    ok "repack on a full disk: completed shards whole; resumed with room, the container's ids are the source's"
else
    bad "repack after the full disk: shards $whole, resume rc $rc, $(tail -1 "$T/repacked.err")"
fi
# 3. place's stripe copies on a full drive: no placement file until every
# copy is whole; with room the same command completes
n=$((n + 1))
mkdir "$T/full2" && mount -t tmpfs -o size=256k k3relfull2 "$T/full2" && MNTS+=("$T/full2") ||
    bad "cannot mount a second tmpfs"
timeout 120 /usr/bin/time -f '%M' -o "$T/p1.rss" "$C" place --model "$TINY" --drives "$T/full2" \
    --copy --usage off --out "$T/full2.json" >"$T/p1.out" 2>&1
rc=$?
r=$(peak "$T/p1.rss")
[ "$r" -gt "$rss" ] && rss=$r
msg=$(grep -m1 'No space left on device' "$T/p1.out")
if [ $rc -ne 0 ] && echo "$msg" | grep -q "$T/full2/k3-stripe/model-[0-9-]*of-[0-9]*.safetensors.tmp: write at offset [0-9]*: No space" &&
    ! [ -e "$T/full2.json" ]; then
    err_n=$((err_n + 1))
    ok "place on a full drive: exit $rc, no placement file, named: $(echo "$msg" | sed "s|$T|T|g" | cut -c1-160)"
else
    bad "place on a full drive: rc $rc, placement file $([ -e "$T/full2.json" ] && echo written || echo absent): $(tail -1 "$T/p1.out")"
fi
mount -o remount,size=8m "$T/full2"
timeout 120 "$C" place --model "$TINY" --drives "$T/full2" --copy --usage off --out "$T/full2.json" \
    >"$T/p2.out" 2>&1
rc=$?
gen placed2 --local 2 --placement "$T/full2.json"
if [ $rc -eq 0 ] && [ "$(grep '^ids:' "$T/placed2.out")" = "$REF" ]; then
    ok_n=$((ok_n + 1))
    ok "place after the full drive: the same command completes, the run on it has the reference ids"
else
    bad "place after the full drive: rc $rc, $(tail -1 "$T/p2.out") $(tail -1 "$T/placed2.err")"
fi
echo "ROW|full disk (512 / 256 KiB tmpfs): the usage history written at the end of a run; a repack's output; place's stripe copies; then repack and place rerun with room|$n|$ok_n (run's ids kept / repack and place completed, same ids)|$err_n (path and ENOSPC named)|$rss kB|-"
exit $fail
