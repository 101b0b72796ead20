# tests/workstation_lib.sh: what the workstation tests share (test_repack.sh,
# test_doctor.sh, test_plan.sh, test_workstation.sh). Sourced after
# tests/lib.sh and make_tmp.
#   ws_edit_header DIR swap|noqs   breaks a container's
#                      layers.3 kv_a_proj_with_mqa: swap = its shape reversed
#                      (same bytes), noqs = its .qs sidecar renamed away;
#                      prints the tensor's name
# Throttled loop-device "drives" (as root): The mechanism of
# tests/bench/bench-drives.sh: a file in /dev/shm behind a loop device with
# ext4, mounted under $T; reads are throttled by a cgroup v1 blkio group
# whose read_bps_device limits each loop device, and the measuring process
# runs in that group. Everything is named workstation_* and removed by
# ws_cleanup (set as the EXIT trap by ws_init).
#   ws_init            skips (exit 0) unless loop devices and blkio work
#   ws_drive NAME MB   a mounted drive $T/NAME of MB megabytes, path in WS_DIR
#                      (not printed: it must run in this shell, not a $(...))
#   ws_throttle DIR MBPS   read limit of DIR's device in the group
#   ws_in_cg CMD...    runs CMD inside the group
WS_TAG=workstation_$$
WS_CG=/sys/fs/cgroup/blkio/$WS_TAG
WS_LOOPS=()
WS_MOUNTS=()

ws_cleanup() {
    local x
    for x in "${WS_MOUNTS[@]}"; do umount "$x" 2>/dev/null || umount -l "$x" 2>/dev/null; done
    for x in "${WS_LOOPS[@]}"; do losetup -d "$x" 2>/dev/null; done
    rm -f /dev/shm/"$WS_TAG".*.img
    [ -d "$WS_CG" ] && rmdir "$WS_CG" 2>/dev/null
    k3_cleanup
}

ws_init() {
    need_root "${1:-throttled loop drives}"
    trap ws_cleanup EXIT
    local t
    for t in losetup mkfs.ext4 mount umount lsblk; do
        command -v $t >/dev/null || { skip "${1:-drives}" "no $t"; exit 0; }
    done
    [ -e /sys/fs/cgroup/blkio/blkio.throttle.read_bps_device ] ||
        { skip "${1:-drives}" "no cgroup v1 blkio throttle"; exit 0; }
    mkdir "$WS_CG" 2>/dev/null || { skip "${1:-drives}" "cannot create $WS_CG"; exit 0; }
    truncate -s 8M "/dev/shm/$WS_TAG.probe.img"
    local l
    l=$(losetup --find --show "/dev/shm/$WS_TAG.probe.img" 2>/dev/null) ||
        { skip "${1:-drives}" "cannot attach a loop device"; exit 0; }
    losetup -d "$l"
    rm -f "/dev/shm/$WS_TAG.probe.img"
}

ws_drive() { # name mb
    local img=/dev/shm/$WS_TAG.$1.img loop
    truncate -s "$2M" "$img"
    loop=$(losetup --find --show "$img") || return 1
    WS_LOOPS+=("$loop")
    mkfs.ext4 -q -F -m 0 "$loop" || return 1
    mkdir -p "$T/$1"
    mount -o noatime "$loop" "$T/$1" || return 1
    WS_MOUNTS+=("$T/$1")
    WS_DIR=$T/$1
}

ws_throttle() { # dir mbps
    local dev majmin
    dev=$(findmnt -no SOURCE --target "$1")
    majmin=$(lsblk -dno MAJ:MIN "$dev" | tr -d ' ')
    echo "$majmin $(($2 * 1000000))" >"$WS_CG/blkio.throttle.read_bps_device"
}

ws_in_cg() { # cmd...
    sh -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' sh "$WS_CG" "$@"
}

ws_edit_header() { # dir swap|noqs
    /usr/bin/python3 - "$1" "$2" <<'PY'
import json, struct, sys
d, mode = sys.argv[1], sys.argv[2]
wm = json.load(open(d + "/model.safetensors.index.json"))["weight_map"]
name = sorted(k for k in wm if k.endswith("layers.3.self_attn.kv_a_proj_with_mqa.weight"))[0]
path = d + "/" + wm[name]
raw = open(path, "rb").read(); n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
if mode == "swap":
    h[name]["shape"] = h[name]["shape"][::-1]
else:
    h[name + ".qz"] = h.pop(name + ".qs")
items = sorted(h.items(), key=lambda kv: kv[1]["data_offsets"][0])
text = json.dumps(dict(items), separators=(",", ":"))
text += " " * (n - len(text))
assert len(text) == n
open(path, "wb").write(raw[:8] + text.encode() + raw[8 + n:])
print(name)
PY
}
