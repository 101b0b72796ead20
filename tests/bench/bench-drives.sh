#!/usr/bin/env bash
# tests/bench/bench-drives.sh: do drives add up? (`make bench-drives`)
# Printed, not asserted. Needs root; skips with the reason otherwise.
#
# For N = 1, 2, 4 workers (NS), it makes N slow "drives" that behave like
# real ones and gives each worker its own:
#   - a file in /dev/shm behind a loop device with an ext4 file system,
#     holding the shards of that worker's layers (copied with O_DIRECT from
#     the checkpoint, so the data is in RAM once);
#   - a cgroup v1 blkio group whose blkio.throttle.read_bps_device limits
#     reads from that loop device to DRIVE_MBPS (default 200 MB/s); the
#     worker runs inside it, so the kernel throttles its O_DIRECT expert
#     reads.
# The model directory the programs get holds only config, tokenizer, index
# and the embedding/head shard (coordinator only); a worker finds its
# shards on its drive (--dirs). Workers load unthrottled, then the throttle
# is set, checked with dd in each group, and the page cache dropped.
# tests/bench/bench_drives.c then runs, on the cluster of those workers:
#   prefill of a PROMPT-token prompt (one session, chunk CHUNK cut into
#   PIPE_CHUNK micro-chunks that pipeline through the stages), tokens/s;
#   decode of DECODE tokens by that session, ms/token;
#   N sessions decoding SESS_TOKENS tokens each at once, aggregate tokens/s
#   (steady rate: (tokens - 1) / (last - first step completion));
# each with per-drive read GB/s, per-stage busy time, CPU use and what
# bounded it (drives, CPU, or the pipeline itself).
# Expert cache: CACHE_PER=layer (default): SLOTS (default 4) slots per MoE
# layer in every configuration (each worker's --expert-gb covers its MoE
# layers), far below a layer's 24 experts: experts stream from the drives,
# and only the drives add up. CACHE_PER=worker: every worker gets the
# 1-worker configuration's budget (SLOTS x all MoE layers), as separate
# hosts or NUMA nodes each bring their own RAM: drives and RAM add up.
# Checkpoint: DRIVES_SLICE (default $CACHE/slice-l5e24: k3_gen slice with 5
# layers = 1 dense + 4 MoE, 24 experts of real size; generated when
# missing, 9.1 GB on disk). Layers are split so each worker holds the same
# number of MoE layers (the dense layer 0 goes with the first). REPACK=1
# (default): drives and workers use "$DRIVES_SLICE"_c4, a --bits 4
# container of it made once (workers load in seconds, same bits).
# STRIPE=0: the configuration above (each worker's layers on its own drive);
# STRIPE=1: expert striping (docs/CLUSTER.md): `k3-coordinator place` spreads
# every MoE layer's experts over the N drives (sparse copies), the workers
# (same layer split) read them with --placement, one read queue per drive,
# all in one cgroup that throttles each of the N devices; dense weights come
# from the checkpoint (read at load, unthrottled).
# STRIPE=2: cross-worker striping (worker/xstripe.h): the same placement and
# layer split, but worker i reads only drive i (its own cgroup throttles its
# own device, as on separate hosts) and serves drive i's experts of every
# MoE layer to the other stages (EXPERT_CALL over ipc); its expert budget
# spans every MoE layer, XSLOTS (default max(1, SLOTS / N)) slots per
# layer, so the N workers together hold about SLOTS per layer like the
# other modes.
# STRIPE=3: STRIPE=1 with a byte-split placement (`place --split`: every
# expert's bytes cut over the N drives, so every MoE layer reads 1/N from
# each drive); STRIPE=split = 0 1 3 (expert-grained and byte-split side by
# side).
# Default (STRIPE=all): each N run unstriped, striped, cross-worker
# striped and byte-split, so the four are measured side by side;
# STRIPE=both = 0 and 1;
# STRIPE=pair = 0 and 2 (the issue's pair: today's layout and the best
# striped one; with N = 1 the layouts are one, measured once).
# Everything made here (loop devices, mounts, cgroups, /dev/shm files,
# worker processes) is removed on exit, failure or interrupt.
set -euo pipefail
BUILD=${BUILD:-build}
CACHE=${CACHE:-$HOME/.cache/k3shard}
PY=/usr/bin/python3
cd "$(dirname "$0")/../.."

NS=${NS:-1 2 4}
DRIVE_MBPS=${DRIVE_MBPS:-200}   # per drive, MB/s (1e6 B/s)
PROMPT=${PROMPT:-256}
CHUNK=${CHUNK:-256}
PIPE_CHUNK=${PIPE_CHUNK:-32}
DECODE=${DECODE:-3}
SESS_TOKENS=${SESS_TOKENS:-4}
SLOTS=${SLOTS:-4}
CACHE_PER=${CACHE_PER:-layer} # layer | worker (see above)
# compute threads per worker: all = every core each (the workers then
# oversubscribe the cores when N > cores); split = cores / N (at least 1),
# as workers on their own NUMA nodes or hosts would have
WORKER_THREADS=${WORKER_THREADS:-all}
STRIPE=${STRIPE:-all} # 0 = per-worker drives, 1 = striped over all drives, 2 = cross-worker, 3 = byte-split (1 with place --split), both = 0 1, pair = 0 2, split = 0 1 3, all = 0 1 2 3
case $STRIPE in 0) MODES=0 ;; 1) MODES=1 ;; 2) MODES=2 ;; 3) MODES=3 ;; both) MODES="0 1" ;; pair) MODES="0 2" ;; split) MODES="0 1 3" ;; all) MODES="0 1 2 3" ;; *) echo "bench-drives: STRIPE=$STRIPE: 0, 1, 2, 3, both, pair, split or all" >&2; exit 2 ;; esac
case $WORKER_THREADS in all | split) ;; *) echo "bench-drives: WORKER_THREADS=$WORKER_THREADS: all or split" >&2; exit 2 ;; esac
case $CACHE_PER in layer | worker) ;; *) echo "bench-drives: CACHE_PER=$CACHE_PER: layer or worker" >&2; exit 2 ;; esac
LOAD_TIMEOUT=${LOAD_TIMEOUT:-600} # s for the workers to load
SLICE=${DRIVES_SLICE:-$CACHE/slice-l5e24}
CG=/sys/fs/cgroup/blkio

skip() { echo "bench-drives: skipped: $*"; exit 0; }
[ "$(id -u)" = 0 ] ||
    skip "needs root (loop devices, mount, the cgroup v1 blkio throttle, drop_caches)"
[ -e "$CG/blkio.throttle.read_bps_device" ] ||
    skip "no cgroup v1 blkio hierarchy with throttling at $CG"
[ -c /dev/loop-control ] || skip "no /dev/loop-control (loop devices)"
for t in losetup mkfs.ext4 mount umount lsblk dd; do
    command -v "$t" >/dev/null || skip "$t is not installed"
done

# BENCH_TAG prefixes the /tmp directory, the /dev/shm files and the cgroups
# (a shared machine: each user's own prefix)
BENCH_TAG=${BENCH_TAG:-k3drives}
T=$(mktemp -d "${TMPDIR:-/tmp}/$BENCH_TAG.XXXXXX")
TAG=$BENCH_TAG.$$
PIDS=() MOUNTS=() LOOPS=() IMGS=() CGS=() DRIVER=""

stop_workers() {
    local p
    if [ -n "$DRIVER" ]; then kill -TERM "$DRIVER" 2>/dev/null || true; wait "$DRIVER" 2>/dev/null || true; DRIVER=""; fi
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null || true
        wait "$p" 2>/dev/null || true
    done
    PIDS=()
}
teardown() {  # everything this run made, in reverse order; never fails
    local x
    stop_workers
    for x in "${MOUNTS[@]}"; do umount "$x" 2>/dev/null || umount -l "$x" 2>/dev/null || true; done
    for x in "${LOOPS[@]}"; do losetup -d "$x" 2>/dev/null || true; done
    for x in "${IMGS[@]}"; do rm -f "$x"; done
    for x in "${CGS[@]}"; do rmdir "$x" 2>/dev/null || true; done
    MOUNTS=() LOOPS=() IMGS=() CGS=()
}
cleanup() { teardown; rm -rf "$T"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# A loop device must be creatable here (containers often cannot).
truncate -s 64M "/dev/shm/$TAG.probe.img"
IMGS+=("/dev/shm/$TAG.probe.img")
probe=$(losetup --find --show "/dev/shm/$TAG.probe.img" 2>&1) ||
    skip "cannot attach a loop device: $probe"
LOOPS+=("$probe")
mkdir "$CG/$TAG.probe" 2>/dev/null || skip "cannot create a blkio cgroup under $CG"
CGS+=("$CG/$TAG.probe")
teardown

# ---- the checkpoint -------------------------------------------------------
if [ ! -f "$SLICE/config.json" ]; then
    echo "bench-drives: generating the checkpoint in $SLICE (slice, 5 layers, 24 experts)"
    $PY tests/fixtures/k3_gen.py --profile slice --layers 5 --experts 24 --out "$SLICE"
fi
# REPACK=1 (default): the drives and workers use a repacked container of the
# slice (k3-coordinator repack --bits 4: the dense matrices already in the
# form the workers' default --bits 4 makes at load, experts byte-identical),
# made once next to the slice ("$SLICE"_c4, 4.4 GB, ~40 s): a worker then
# loads by reading, in seconds, where quantizing the BF16 slice took
# minutes. REPACK=0 uses the slice itself.
REPACK=${REPACK:-1}
case $REPACK in 0 | 1) ;; *) echo "bench-drives: REPACK=$REPACK: 0 or 1" >&2; exit 2 ;; esac
SRC=$SLICE
if [ "$REPACK" = 1 ]; then
    SRC=${SLICE}_c4
    make --no-print-directory -s BUILD="$BUILD" "$BUILD/k3-coordinator"
    # one maker at a time (another user's run may be making it); .tmp until whole
    exec 9>"$CACHE/.$(basename "$SLICE")_c4.lock"
    flock 9
    # a slice generated again after the container was made: make it again
    if [ -f "$SRC/model.safetensors.index.json" ] &&
        [ "$SLICE/model.safetensors.index.json" -nt "$SRC/model.safetensors.index.json" ]; then
        echo "bench-drives: $SLICE is newer than $SRC: repacking again"
        rm -rf "$SRC"
    fi
    if [ ! -f "$SRC/model.safetensors.index.json" ]; then
        echo "bench-drives: repacking $SLICE into $SRC (--bits 4, once)"
        "$BUILD/k3-coordinator" repack "$SLICE" "$SRC.tmp" --bits 4 --quiet
        mv "$SRC.tmp" "$SRC"
    fi
    exec 9>&-
fi
# the model directory: everything but the decoder layers' shards
mkdir -p "$T/model"
for f in "$SRC"/*; do
    case $f in *.safetensors) ;; *) ln -s "$f" "$T/model/" ;; esac
done
# shellcheck disable=SC2016
PLAN_PY='
import json, os, re, struct, sys
d, n_workers, slots, cache_per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
c = json.load(open(os.path.join(d, "config.json")))
tc = c.get("text_config", c)
L, k = tc["num_hidden_layers"], tc.get("first_k_dense_replace", 0)
wm = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
layer_of = {}
for key, f in wm.items():
    m = re.search(r"(?:^|\.)model\.layers\.(\d+)\.", key)
    if m and not key.startswith(("vision_tower", "mm_projector")):
        layer_of.setdefault(f, set()).add(int(m.group(1)))
moe = list(range(k, L))
if n_workers > len(moe):
    sys.exit("%d workers but only %d MoE layers" % (n_workers, len(moe)))
# bytes of one expert (all its tensors) from the first MoE layer shard header
pre = "model.layers.%d.block_sparse_moe.experts.0." % k
ebytes = 0
for f in sorted(set(wm.values())):
    if k not in layer_of.get(f, ()):
        continue
    with open(os.path.join(d, f), "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        h = json.loads(fh.read(n))
    for name, t in h.items():
        if name != "__metadata__" and pre in name:
            ebytes += t["data_offsets"][1] - t["data_offsets"][0]
if ebytes == 0:
    sys.exit("no expert 0 tensors found for layer %d" % k)
slot = -(-(ebytes + 2 * 4096) // 4096) * 4096
start = 0
for i in range(n_workers):
    lo, hi = len(moe) * i // n_workers, len(moe) * (i + 1) // n_workers
    end = L if i == n_workers - 1 else moe[hi - 1] + 1
    shards = sorted(f for f, ls in layer_of.items() if any(start <= l < end for l in ls))
    per = hi - lo if cache_per == "layer" else len(moe)  # MoE layers the budget covers
    gb = per * slots * slot * 1.02 / (1 << 30)           # just over SLOTS per such layer
    size = sum(os.path.getsize(os.path.join(d, f)) for f in shards)
    print(i, start, end, hi - lo, "%.4f" % gb, size, *shards)
    start = end
'
# the decoder-layer shards go to the drives; the rest stays in the model dir
layer_shards=$($PY -c "
import json, re
wm = json.load(open('$SRC/model.safetensors.index.json'))['weight_map']
print(' '.join(sorted({f for k, f in wm.items() if re.search(r'(?:^|\.)model\.layers\.\d+\.', k)
                       and not k.startswith(('vision_tower', 'mm_projector'))})))")
for f in "$SRC"/*.safetensors; do
    case " $layer_shards " in *" $(basename "$f") "*) ;; *) ln -s "$f" "$T/model/" ;; esac
done
total=0
for f in $layer_shards; do total=$((total + $(stat -c %s "$SRC/$f"))); done
shm_free=$(($(df -k --output=avail /dev/shm | tail -1) * 1024))
mem_avail=$(($(awk '/MemAvailable/ {print $2}' /proc/meminfo) * 1024))
need=$((total + total / 20 + 1024 * 1024 * 1024))
[ "$shm_free" -ge "$need" ] ||
    skip "/dev/shm has $((shm_free >> 20)) MiB free, the drives need $((need >> 20)) MiB"
[ "$mem_avail" -ge $((need + 3 * 1024 * 1024 * 1024)) ] ||
    skip "MemAvailable $((mem_avail >> 20)) MiB < drives $((need >> 20)) MiB + 3 GiB for the workers"

# ---- the coordinator-side driver ------------------------------------------
make --no-print-directory -s BUILD="$BUILD" all "$BUILD/bench/bench_drives"

echo "bench-drives: $SRC ($((total / 1000000)) MB of layer shards), $(nproc) cores,"\
     "drives of $DRIVE_MBPS MB/s (loop + ext4 in /dev/shm, blkio throttle), $SLOTS expert"\
     "slots per MoE layer $([ "$CACHE_PER" = worker ] && echo "of the model for every worker (CACHE_PER=worker)" || echo "of each worker (CACHE_PER=layer)"),"\
     "prompt $PROMPT, chunk $CHUNK / pipe-chunk $PIPE_CHUNK, worker threads $WORKER_THREADS"
t_all=$(date +%s)

# Waits until workers 0..N-1 listen (a worker binds once it has loaded).
wait_loaded() {
    local N=$1 i t0; t0=$(date +%s)
    for i in $(seq 0 $((N - 1))); do
        until [ -S "$T/w$i.sock" ]; do
            if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
                echo "bench-drives: worker $i exited while loading:"; tail -5 "$T/w$i.log"; return 1
            fi
            if [ $(($(date +%s) - t0)) -gt "$LOAD_TIMEOUT" ]; then
                echo "bench-drives: worker $i not listening after $LOAD_TIMEOUT s"; return 1
            fi
            sleep 0.5
        done
    done
}

# The layer split and budgets (plan) and the compute threads per worker
# (wthreads) for N workers, set in the caller's locals of those names.
plan_for() {
    plan=$($PY -c "$PLAN_PY" "$SRC" "$1" "$SLOTS" "$CACHE_PER") || return 1
    wthreads=$(nproc)
    if [ "$WORKER_THREADS" = split ]; then
        wthreads=$(($(nproc) / $1))
        [ "$wthreads" -ge 1 ] || wthreads=1
    fi
}

# ---- one configuration ------------------------------------------------------
run_n() {
    local N=$1 M=${2:-0} i a b nmoe gb size shards plan loop dev majmin cg eps="" devs="" pids="" big
    [ "$M" = 1 ] && { run_striped "$N"; return; }
    [ "$M" = 2 ] && { run_striped "$N" x; return; }
    [ "$M" = 3 ] && { run_striped "$N" "" split; return; }
    local wthreads
    plan_for "$N" || return 1
    echo
    echo "=== $N worker(s), $N drive(s), STRIPE=0 (each worker's layers on its drive) ==="
    local t_setup; t_setup=$(date +%s)
    while read -r i a b nmoe gb size shards; do
        IMGS+=("/dev/shm/$TAG.$i.img")
        truncate -s $(((size + size / 20) / 1048576 * 1048576 + 256 * 1048576)) "/dev/shm/$TAG.$i.img"
        loop=$(losetup --find --show "/dev/shm/$TAG.$i.img")
        LOOPS+=("$loop")
        mkfs.ext4 -q -F -m 0 "$loop"
        mkdir -p "$T/drive$i"
        mount -o noatime "$loop" "$T/drive$i"
        MOUNTS+=("$T/drive$i")
        for f in $shards; do  # O_DIRECT both ways: the shard is in RAM once
            dd if="$SRC/$f" of="$T/drive$i/$f" bs=16M iflag=direct oflag=direct status=none
        done
        cg=$CG/$TAG.$i
        mkdir "$cg"
        CGS+=("$cg")
        rm -f "$T/w$i.sock" # another configuration's: bound again once loaded
        # the worker starts inside its drive's cgroup (the shell execs into it)
        sh -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' sh "$cg" \
            "$BUILD/k3-worker" --model "$T/model" --dirs "$T/drive$i" --layers "$a-$b" \
            --listen "ipc://$T/w$i.sock" --expert-gb "$gb" --usage off --no-bench --threads "$wthreads" \
            --name "drive$i" >"$T/w$i.log" 2>&1 &
        PIDS+=($!)
        dev=$(basename "$loop")
        echo "  worker $i: layers [$a, $b) ($nmoe MoE), $shards on $dev ($((size / 1000000)) MB)," \
             "expert budget $gb GiB, pid ${PIDS[-1]}"
        eps+="${eps:+,}ipc://$T/w$i.sock" devs+="${devs:+,}$dev" pids+="${pids:+,}${PIDS[-1]}"
    done <<<"$plan"
    echo "  drives made and filled in $(($(date +%s) - t_setup)) s"
    local t0; t0=$(date +%s)
    wait_loaded "$N" || return 1
    echo "  workers loaded in $(($(date +%s) - t0)) s (unthrottled); throttle on:"
    for i in $(seq 0 $((N - 1))); do
        loop=${LOOPS[$i]}
        majmin=$(lsblk -dno MAJ:MIN "$loop" | tr -d ' ')
        cg=${CGS[$i]}
        echo "$majmin $((DRIVE_MBPS * 1000000))" >"$cg/blkio.throttle.read_bps_device"
        # shellcheck disable=SC2012
        big=$(ls -S "$T/drive$i"/*.safetensors | head -1)
        # the check: ~1.5 s of O_DIRECT reads from inside the group (the
        # throttle lets a short burst through: a shorter read overstates it)
        rate=$(sh -c 'echo $$ > "$1/cgroup.procs" && exec dd if="$2" of=/dev/null bs=16M count="$3" iflag=direct' \
                  sh "$cg" "$big" $((DRIVE_MBPS * 3 / 32 + 1)) 2>&1 | tail -1 | sed 's/.*, //')
        echo "    drive $i ($(basename "$loop"), $majmin): limit $DRIVE_MBPS MB/s, dd O_DIRECT in its group: $rate"
    done
    sync
    echo 3 >/proc/sys/vm/drop_caches
    # the driver runs in the background so that a signal interrupts `wait`
    # at once (the trap then stops it); a tail streams its output meanwhile
    drive "$N.0" "$T/model" "$eps" "$devs" "$pids"
}

# The driver on a cluster that is up: drive TAG MODEL EPS DEVS PIDS
drive() {
    local tag=$1 model=$2 eps=$3 devs=$4 pids=$5 i
    : >"$T/out$tag"
    "$BUILD/bench/bench_drives" --model "$model" --workers "$eps" --drives "$devs" \
        --pids "$pids" --drive-mbps "$DRIVE_MBPS" --prompt "$PROMPT" --chunk "$CHUNK" \
        --pipe-chunk "$PIPE_CHUNK" --decode "$DECODE" --sess-prompt 1 --sess-tokens "$SESS_TOKENS" \
        >"$T/out$tag" 2>"$T/coord$tag.log" &
    DRIVER=$!
    tail --pid="$DRIVER" -n +1 -f "$T/out$tag" 2>/dev/null | sed -u 's/^/  /' &
    local tailer=$! rc=0
    wait "$DRIVER" || rc=$?
    DRIVER=""
    wait "$tailer" 2>/dev/null || true
    [ "$rc" = 0 ] || { echo "bench-drives: the driver failed (exit $rc):"; tail -5 "$T/coord$tag.log"; return 1; }
    grep -q '^result decodeN' "$T/out$tag" ||
        { echo "bench-drives: the driver failed:"; tail -5 "$T/coord$tag.log";
          for i in "${!PIDS[@]}"; do tail -3 "$T/w$i.log"; done; return 1; }
    local nw=${#PIDS[@]}
    teardown
    # STRIPE=2: each worker's expert-call figures, logged as it stops
    # (round trip per call against the peer's compute and read wait)
    for i in $(seq 0 $((nw - 1))); do
        grep -h 'expert calls:' "$T/w$i.log" 2>/dev/null | sed 's/^[^ ]* [^ ]* [^ ]* /  /' || true
    done
}

# ---- one striped configuration (STRIPE=1) ------------------------------------
# N drives hold every MoE layer's experts striped (k3-coordinator place); the
# N workers (same layer split and budgets) read all drives, in one cgroup
# throttling each device to DRIVE_MBPS.
run_striped() {
    local N=$1 X=${2:-} S=${3:-} mt=1 i a b nmoe gb size shards plan loop dev majmin cg eps="" devs="" pids="" dlist=""
    local wthreads
    plan_for "$N" || return 1
    [ -n "$S" ] && mt=3
    echo
    if [ -n "$X" ]; then
        echo "=== $N worker(s), $N drive(s), STRIPE=2 (striped; worker i reads drive i only and serves it to the others) ==="
    else
        echo "=== $N worker(s), $N drive(s), STRIPE=$mt (every MoE layer's experts striped over all drives${S:+, the bytes of each expert split over them}) ==="
    fi
    local t_setup; t_setup=$(date +%s)
    mkdir -p "$T/smodel"
    for f in "$SRC"/*; do [ -e "$T/smodel/$(basename "$f")" ] || ln -s "$f" "$T/smodel/"; done
    local per=$(((total / N + total / 20) / 1048576 * 1048576 + 256 * 1048576))
    for i in $(seq 0 $((N - 1))); do
        IMGS+=("/dev/shm/$TAG.s$i.img")
        truncate -s "$per" "/dev/shm/$TAG.s$i.img"
        loop=$(losetup --find --show "/dev/shm/$TAG.s$i.img")
        LOOPS+=("$loop")
        mkfs.ext4 -q -F -m 0 "$loop"
        mkdir -p "$T/sdrive$i"
        mount -o noatime "$loop" "$T/sdrive$i"
        MOUNTS+=("$T/sdrive$i")
        dlist+="${dlist:+,}$T/sdrive$i" devs+="${devs:+,}$(basename "$loop")"
    done
    "$BUILD/k3-coordinator" place --model "$T/smodel" --drives "$dlist" --usage off ${S:+--split} \
        --out "$T/placement.json" 2>&1 | tail -$((N + 1)) | sed 's/^/  /' || return 1
    [ -s "$T/placement.json" ] || { echo "bench-drives: place failed"; return 1; }
    [ -n "$X" ] && { run_xworkers "$N" "$devs"; return; }
    cg=$CG/$TAG.stripe
    mkdir "$cg"
    CGS+=("$cg")
    i=0
    while read -r i a b nmoe gb size shards; do
        rm -f "$T/w$i.sock" # the previous configuration's: bound again once loaded
        sh -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' sh "$cg" \
            "$BUILD/k3-worker" --model "$T/smodel" --placement "$T/placement.json" --layers "$a-$b" \
            --listen "ipc://$T/w$i.sock" --expert-gb "$gb" --usage off --no-bench --threads "$wthreads" \
            --name "stripe$i" >"$T/w$i.log" 2>&1 &
        PIDS+=($!)
        echo "  worker $i: layers [$a, $b) ($nmoe MoE), experts on all $N drives, expert budget $gb GiB, pid ${PIDS[-1]}"
        eps+="${eps:+,}ipc://$T/w$i.sock" pids+="${pids:+,}${PIDS[-1]}"
    done <<<"$plan"
    echo "  drives made and filled in $(($(date +%s) - t_setup)) s"
    local t0; t0=$(date +%s)
    wait_loaded "$N" || return 1
    echo "  workers loaded in $(($(date +%s) - t0)) s (unthrottled); throttle on (one group, every device):"
    for i in $(seq 0 $((N - 1))); do
        majmin=$(lsblk -dno MAJ:MIN "${LOOPS[$i]}" | tr -d ' ')
        echo "$majmin $((DRIVE_MBPS * 1000000))" >"$cg/blkio.throttle.read_bps_device"
    done
    for i in $(seq 0 $((N - 1))); do
        loop=${LOOPS[$i]}
        # the device itself: a drive file is sparse, and holes read no blocks
        rate=$(sh -c 'echo $$ > "$1/cgroup.procs" && exec dd if="$2" of=/dev/null bs=16M count="$3" iflag=direct' \
                  sh "$cg" "$loop" $((DRIVE_MBPS * 3 / 32 + 1)) 2>&1 | tail -1 | sed 's/.*, //')
        echo "    drive $i ($(basename "$loop")): limit $DRIVE_MBPS MB/s, dd O_DIRECT in the group: $rate"
    done
    sync
    echo 3 >/proc/sys/vm/drop_caches
    drive "$N.$mt" "$T/smodel" "$eps" "$devs" "$pids"
}

# STRIPE=2 after run_striped made the drives and the placement: worker i
# in its own cgroup throttling drive i, --stripe-drives i, the others as
# peers.
run_xworkers() {
    local N=$1 devs=$2 i j a b nmoe gb size shards eps="" pids="" peers cg majmin loop rate
    local per_layer nmoe_all slots_x
    nmoe_all=$(echo "$plan" | awk '{s += $4} END {print s}')
    slots_x=${XSLOTS:-$((SLOTS / N))}; [ "$slots_x" -ge 1 ] || slots_x=1
    # GiB per slot-layer from worker 0's CACHE_PER=layer figure
    per_layer=$(echo "$plan" | head -1 | awk -v s="$SLOTS" -v w="$CACHE_PER" -v n="$nmoe_all" \
        '{printf "%.6f", $5 / (w == "worker" ? n : $4) / s}')
    gb=$(awk -v p="$per_layer" -v n="$nmoe_all" -v k="$slots_x" 'BEGIN {printf "%.4f", p * n * k}')
    while read -r i a b nmoe _ size shards; do
        rm -f "$T/w$i.sock" "$T/x$i.sock"
        peers=""
        for j in $(seq 0 $((N - 1))); do
            [ "$j" = "$i" ] || peers+="${peers:+,}$j=ipc://$T/x$j.sock"
        done
        cg=$CG/$TAG.x$i
        mkdir "$cg"
        CGS+=("$cg")
        sh -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' sh "$cg" \
            "$BUILD/k3-worker" --model "$T/smodel" --placement "$T/placement.json" --layers "$a-$b" \
            --listen "ipc://$T/w$i.sock" --expert-gb "$gb" --usage off --no-bench --threads "$wthreads" \
            --stripe-drives "$i" --expert-listen "ipc://$T/x$i.sock" --stripe-peers "$peers" \
            --name "xstripe$i" >"$T/w$i.log" 2>&1 &
        PIDS+=($!)
        echo "  worker $i: layers [$a, $b) ($nmoe MoE), reads drive $i only (every MoE layer's share), serves it to the others;" \
             "expert budget $gb GiB ($slots_x slots x $nmoe_all MoE layers), pid ${PIDS[-1]}"
        eps+="${eps:+,}ipc://$T/w$i.sock" pids+="${pids:+,}${PIDS[-1]}"
    done <<<"$plan"
    local t0; t0=$(date +%s)
    wait_loaded "$N" || return 1
    echo "  workers loaded in $(($(date +%s) - t0)) s (unthrottled); throttle on (worker i's group, drive i):"
    for i in $(seq 0 $((N - 1))); do
        loop=${LOOPS[$i]}
        majmin=$(lsblk -dno MAJ:MIN "$loop" | tr -d ' ')
        cg=$CG/$TAG.x$i
        echo "$majmin $((DRIVE_MBPS * 1000000))" >"$cg/blkio.throttle.read_bps_device"
        rate=$(sh -c 'echo $$ > "$1/cgroup.procs" && exec dd if="$2" of=/dev/null bs=16M count="$3" iflag=direct' \
                  sh "$cg" "$loop" $((DRIVE_MBPS * 3 / 32 + 1)) 2>&1 | tail -1 | sed 's/.*, //')
        echo "    drive $i ($(basename "$loop"), $majmin): limit $DRIVE_MBPS MB/s, dd O_DIRECT in its group: $rate"
    done
    sync
    echo 3 >/proc/sys/vm/drop_caches
    drive "$N.2" "$T/smodel" "$eps" "$devs" "$pids"
}

for n in $NS; do
    for m in $MODES; do
        # one drive striped is the unstriped layout (it holds every expert):
        # with both modes the 1-drive figures are measured once, as STRIPE=0
        if [ "$n" = 1 ] && [ "$m" != 0 ] && [ -f "$T/out1.0" ]; then
            cp "$T/out1.0" "$T/out1.$m"
            continue
        fi
        run_n "$n" "$m" || exit 1
    done
done

# ---- summary ------------------------------------------------------------------
field() {  # TAG phase key
    [ -f "$T/out$1" ] || return 0
    awk -v p="$2" -v k="$3" '$1 == "result" && $2 == p {
        for (i = 3; i <= NF; i++) { split($i, kv, "="); if (kv[1] == k) print kv[2] } }' "$T/out$1"
}
# The issue's ratios side by side (docs/PERFORMANCE.md "Expert striping"):
# every figure against the 1-drive figure of the same run (N = 1 is one
# layout, measured once), the N-session rate against STRIPE=0 at the same N.
echo
echo "bench-drives: the issue's ratios ($DRIVE_MBPS MB/s per drive, $(nproc) cores, $SLOTS slots per MoE"\
     "layer; x1 = against 1 drive; targets: decode1 speed >= 0.8 x N, prefill >= 0.85 x N,"\
     "N-session striped / unstriped >= 1.0; decode1 columns: busiest drive's share,"\
     "gather wait ms per MoE layer step (of it on stripe peers), per-drive GB/s)"
printf '  %-3s %-3s | %8s %5s %-9s | %8s %5s %-9s | %8s %5s %-9s | %5s %13s  %s\n' N mode \
       "prefill" x1 "0.85N" "decode1" x1 "0.8N" "decodeN" "/S=0" ">=1.0" share "wait (peer)" "GB/s per drive"
printf '  %-3s %-3s | %8s %5s %-9s | %8s %5s %-9s | %8s %5s %-9s |\n' "" "" "tok/s" "" "" "ms/tok" "" "" "tok/s" "" ""
p1=$(field 1.0 prefill value) d11=$(field 1.0 decode1 value)
for n in $NS; do
    for m in $MODES; do
        [ "$n" = 1 ] && [ "$m" != 0 ] && continue
        awk -v n="$n" -v m="$m" -v p="$(field "$n.$m" prefill value)" -v p1="$p1" \
            -v d1="$(field "$n.$m" decode1 value)" -v d11="$d11" \
            -v dn="$(field "$n.$m" decodeN value)" -v dn0="$(field "$n.0" decodeN value)" \
            -v sh="$(field "$n.$m" decode1 busiest_share)" -v w="$(field "$n.$m" decode1 wait_ms_per_layer)" \
            -v pw="$(field "$n.$m" decode1 peer_wait_ms_per_layer)" -v g="$(field "$n.$m" decode1 drive_gbps)" '
            function verdict(r, t) { return r == "" ? "-" : sprintf("%s %.2f", r >= t ? "pass" : "FAIL", t) }
            BEGIN {
                rp = (p != "" && p1 != "") ? p / p1 : ""; rd = (d1 != "" && d11 != "") ? d11 / d1 : ""
                rn = (dn != "" && dn0 != "" && m != 0) ? dn / dn0 : ""
                vp = n > 1 ? verdict(rp, 0.85 * n) : "-"; vd = n > 1 ? verdict(rd, 0.8 * n) : "-"
                vn = (m != 0) ? verdict(rn, 1.0) : "-"
                printf "  %-3s %-3s | %8.3f %5s %-9s | %8.0f %5s %-9s | %8.3f %5s %-9s | %5.3f %6.1f (%4.1f)  %s\n",
                    n, m, p, rp == "" ? "-" : sprintf("%.2f", rp), vp, d1, rd == "" ? "-" : sprintf("%.2f", rd), vd,
                    dn, rn == "" ? "-" : sprintf("%.2f", rn), vn, sh, w, pw, g }'
    done
done
echo "  prefill wall time vs its drive floor (the busiest drive's bytes at the throttle: the time"\
     "the reads alone need, the figure if compute were free):"
for m in $MODES; do
    for n in $NS; do
        echo "    $n drives, STRIPE=$m: wall $(field "$n.$m" prefill wall_s) s, drive floor $(field "$n.$m" prefill floor_s) s"
    done
done
echo "  per-drive read GB/s, busiest drive's share of the bytes, expert-read (gather) wait per MoE layer step"
echo "  (prefill | 1-session decode | N-session decode):"
for m in $MODES; do
    for n in $NS; do
        echo "    $n drives, STRIPE=$m: $(field "$n.$m" prefill drive_gbps) | $(field "$n.$m" decode1 drive_gbps) | $(field "$n.$m" decodeN drive_gbps);" \
             "share $(field "$n.$m" prefill busiest_share) | $(field "$n.$m" decode1 busiest_share) | $(field "$n.$m" decodeN busiest_share);" \
             "wait ms/layer $(field "$n.$m" prefill wait_ms_per_layer) | $(field "$n.$m" decode1 wait_ms_per_layer) | $(field "$n.$m" decodeN wait_ms_per_layer)"\
             "(on stripe peers $(field "$n.$m" prefill peer_wait_ms_per_layer) | $(field "$n.$m" decode1 peer_wait_ms_per_layer) | $(field "$n.$m" decodeN peer_wait_ms_per_layer))"
    done
done
echo "bench-drives: done in $(($(date +%s) - t_all)) s"
