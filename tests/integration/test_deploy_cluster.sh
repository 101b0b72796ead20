#!/usr/bin/env bash
# tests/integration/test_deploy_cluster.sh: deploy/cluster (docs/DEPLOY.md,
# "Small cluster") on three "hosts": network namespaces joined by a bridge,
# each running its own sshd on its own address, deployed by ansible-playbook
# over ssh with a test inventory: one coordinator host, two worker hosts with
# two loop-device drives each. The playbook measures the drives on each host
# and plans with `k3-coordinator plan --hosts`: one worker per host (the
# loop drives have no NUMA node), its layers in proportion to its drives'
# measured speed, its experts striped over both drives (`place`).
#  D1 the playbook deploys; serve answers and its text equals --local 0's;
#     the plan it used: both hosts' drives measured, the layers covered once,
#     each worker striped over its two drives by their speeds
#  D2 a second run changes nothing (PLAY RECAP changed=0 on every host)
#  D3 status (playbook and command): one row per worker, all ok, with the
#     plan's layer range and the real stripe (each drive's share of experts)
#  D4 the deployed workers' logits are bit-identical to --local 0 (the
#     coordinator stopped, the CLI run with its key; the playbook restarts it)
#  D5 kill -9 a worker: the supervisor restarts it, a request succeeds with
#     the reference text (its session replayed)
#  D6 iptables DROP on one worker host's link past the deadline: a clear
#     error during, success with the reference text after the restore
#  D7 rolling restart (one host at a time) while a client asks: no error
#  D8 a worker of another build identity and an unknown coordinator key:
#     refused, and status says why
#  D9 tcpdump on a worker host's veth during a request: no plaintext
#     envelope keys or hidden-state bytes (CURVE); the same capture of a plain
#     --insecure link shows them (the detector works)
#  D10 plain tcp off loopback is refused unless --insecure
# Needs root, ansible-playbook, sshd, tcpdump, rsync and loop devices: a skip
# line with the reason otherwise. Everything it creates is named dep*/deploy*
# and removed on exit.
set -u
. "$(dirname "$0")/../lib.sh"
WHAT="D1-D10 deploy/cluster over ssh to three network-namespace hosts"
need_root "$WHAT"
# The rollout (five playbook runs over ssh, 400 s on the 2-core VM) tests the
# deployment tooling, not the programs' memory or thread safety: the
# sanitizer builds cover the same cluster code in test_cluster and
# test_cluster_curve.sh, so CI runs this script in the plain build only.
case "$(basename "$BUILD")" in
build-asan | build-tsan | build-ubsan)
    skip "$WHAT" "the plain build runs it (a sanitizer build adds nothing to an Ansible rollout)"
    exit 0
    ;;
esac
for b in ansible-playbook sshd tcpdump rsync start-stop-daemon iptables losetup mkfs.ext4 curl ssh-keygen; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || {
        skip "$WHAT" "$b not installed (make deps)"
        exit 0
    }
done
C=$(readlink -f "$C")
W=$(readlink -f "$W")
need_bins "$C" "$W"
TINY=$(readlink -f "$TINY")
BUILD_ABS=$(dirname "$C")
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CL=$REPO/deploy/cluster
T0=$(date +%s)

make_tmp deploy_cluster
S=$$
NET=10.79.$((S % 200 + 20))
BR=depbr$((S % 100000))
HOSTS=(depc depw1 depw2)
ADDR=([0]=$NET.1 [1]=$NET.2 [2]=$NET.3)
ns() { echo "dep$((S % 100000))${HOSTS[$1]#dep}"; } # dep<pid>c, dep<pid>w1, ...
LOOPS=()
MOUNTS=()
cleanup() {
    local i
    # the deployed processes: each supervisor's pid file, then anything left in the namespaces
    for f in "$T"/hosts/*/run/k3/*.pid; do
        [ -f "$f" ] && start-stop-daemon --stop --quiet --oknodo --pidfile "$f" --retry TERM/5/KILL/2 >/dev/null 2>&1
    done
    for s in "$T"/cp/*; do # ansible's ssh connection masters
        [ -S "$s" ] && ssh -o ControlPath="$s" -O exit dep 2>/dev/null
    done
    for i in 0 1 2; do
        for p in $(ip netns pids "$(ns $i)" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
        ip netns del "$(ns $i)" 2>/dev/null
        ip link del "dep$((S % 100000))h$i" 2>/dev/null
    done
    ip link del "$BR" 2>/dev/null
    if [ -n "${DEPLOY_KEEP:-}" ]; then # debugging: keep the logs
        mkdir -p "$DEPLOY_KEEP" && cp -r "$T"/*.log "$T"/*.txt "$T"/*.json "$T"/*.err "$T"/*.status \
            "$T"/hosts/*/var/log "$DEPLOY_KEEP"/ 2>/dev/null
    fi
    for m in "${MOUNTS[@]}"; do umount "$m" 2>/dev/null; done
    for l in "${LOOPS[@]}"; do losetup -d "$l" 2>/dev/null; done
    k3_cleanup
}
trap cleanup EXIT

# ---- three hosts: namespaces on a bridge, sshd in each ----
if ! ip link add "$BR" type bridge 2>"$T/ns.err"; then
    skip "$WHAT" "cannot create a bridge: $(head -1 "$T/ns.err")"
    exit 0
fi
ip addr add "$NET.254/24" dev "$BR" && ip link set "$BR" up || {
    skip "$WHAT" "cannot configure the bridge"
    exit 0
}
for i in 0 1 2; do
    n=$(ns $i)
    h=dep$((S % 100000))h$i
    ip netns add "$n" && ip link add "$h" type veth peer name eth0 netns "$n" &&
        ip link set "$h" master "$BR" && ip link set "$h" up &&
        ip -n "$n" addr add "${ADDR[$i]}/24" dev eth0 && ip -n "$n" link set eth0 up &&
        ip -n "$n" link set lo up || {
        skip "$WHAT" "cannot create network namespace $n with a veth"
        exit 0
    }
done
ssh-keygen -q -t ed25519 -N '' -f "$T/id_dep" && ssh-keygen -q -t ed25519 -N '' -f "$T/hostkey" ||
    {
        bad "ssh-keygen failed"
        exit 1
    }
cp "$T/id_dep.pub" "$T/authorized_keys"
mkdir -p /run/sshd
for i in 0 1 2; do
    cat >"$T/sshd_$i.conf" <<EOF
ListenAddress ${ADDR[$i]}
Port 22
HostKey $T/hostkey
PidFile $T/sshd_$i.pid
AuthorizedKeysFile $T/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
Subsystem sftp internal-sftp
EOF
    ip netns exec "$(ns $i)" /usr/sbin/sshd -f "$T/sshd_$i.conf" -E "$T/sshd_$i.log" || {
        bad "sshd in $(ns $i) did not start: $(tail -2 "$T/sshd_$i.log")"
        exit 1
    }
done
SSHO=(-i "$T/id_dep" -o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no -o LogLevel=ERROR -o BatchMode=yes -o ServerAliveInterval=2 -o ServerAliveCountMax=3)
on() { # host-index command...: runs on that "host" over ssh, as an operator would
    local i=$1
    shift
    ssh "${SSHO[@]}" "root@${ADDR[$i]}" "$@"
}
on_bg() { # host-index command...: the same in the background; its ssh's pid joins PIDS
    local i=$1
    shift
    ssh "${SSHO[@]}" "root@${ADDR[$i]}" "$@" &
    PIDS+=($!)
}
for _ in $(seq 50); do on 2 true 2>/dev/null && break; sleep 0.1; done

# ---- drives: two loop devices per worker host, ext4, mounted ----
for i in 1 2; do
    for d in 0 1; do
        img=$T/deploy_${HOSTS[$i]}_d$d.img
        mnt=$T/hosts/${HOSTS[$i]}/mnt/d$d
        mkdir -p "$mnt"
        truncate -s 16M "$img"
        mkfs.ext4 -q -F "$img" >/dev/null 2>&1
        l=$(losetup --find --show "$img" 2>"$T/loop.err") || {
            skip "$WHAT" "no loop device: $(head -1 "$T/loop.err")"
            exit 0
        }
        LOOPS+=("$l")
        mount "$l" "$mnt" || {
            skip "$WHAT" "cannot mount $l"
            exit 0
        }
        MOUNTS+=("$mnt")
    done
done

# ---- the test inventory ----
INV=$T/inventory.yml
cat >"$INV" <<EOF
all:
  vars:
    ansible_user: root
    ansible_ssh_private_key_file: $T/id_dep
    ansible_ssh_common_args: -o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no -o LogLevel=ERROR
    k3_model_src: $TINY
    k3_build_src: $BUILD_ABS
    k3_supervisor: start-stop-daemon
    k3_stage: $T/stage
    k3_worker_port: 5555
    k3_http_port: 8080
    k3_hb_ms: 250
    k3_plan_seconds: 0.3
    k3_worker_args: --threads 1
    k3_serve_args: --threads 1 --resume-wait-ms 8000 --step-timeout-ms 8000
  children:
    k3_coordinator:
      hosts:
        depc: {ansible_host: ${ADDR[0]}, k3_root: $T/hosts/depc, k3_http_host: ${ADDR[0]}}
    k3_workers:
      hosts:
        depw1:
          ansible_host: ${ADDR[1]}
          k3_root: $T/hosts/depw1
          k3_drives: [{path: $T/hosts/depw1/mnt/d0}, {path: $T/hosts/depw1/mnt/d1}]
        depw2:
          ansible_host: ${ADDR[2]}
          k3_root: $T/hosts/depw2
          k3_drives: [{path: $T/hosts/depw2/mnt/d0}, {path: $T/hosts/depw2/mnt/d1}]
EOF
export ANSIBLE_LOCAL_TEMP=$T/ans_local ANSIBLE_REMOTE_TEMP=$T/ans_remote ANSIBLE_SSH_CONTROL_PATH_DIR=$T/cp
export ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0
play() { # log playbook args...
    local log=$1
    shift
    (cd "$CL" && timeout "${DEPLOY_PLAY_TIMEOUT:-900}" ansible-playbook -i "$INV" "$@") >"$T/$log" 2>&1
}
recap_changed() { # log: the sum of changed= over the PLAY RECAP lines
    awk '/PLAY RECAP/{r=1} r && /changed=/{for(i=1;i<=NF;i++) if($i ~ /^changed=/){split($i,a,"="); s+=a[2]}} END{print s+0}' "$T/$1"
}
URL=http://${ADDR[0]}:8080
PROMPT="The deploy test"
complete() { # out: POST /v1/completions, greedy, 8 tokens; prints the text, rc 1 on an error
    curl -s -m 60 "$URL/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"prompt\":\"$PROMPT\",\"max_tokens\":8,\"temperature\":0}" >"$T/$1.json"
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["choices"][0]["text"])' \
        "$T/$1.json" 2>/dev/null
}
"$C" --model "$TINY" --local 0 --threads 1 --usage off --ngen 8 "$PROMPT" >"$T/ref.txt" 2>/dev/null
REF=$(cat "$T/ref.txt")
PLAN=$T/stage/localhost/plan.json # what the playbook planned (plan.yml)
EPS=
CE=$T/hosts/depc/etc/k3
CB=$T/hosts/depc/opt/k3shard/bin
status_cmd() { on 0 "$CB/k3-coordinator" status --workers "$EPS" --curve-secret "$CE/coord.key" --worker-keys "$CE/workers" "$@"; }

# ---- D1: deploy ----
t=$(date +%s)
play site1.log site.yml
rc=$?
d1=$(($(date +%s) - t))
got=$(complete d1)
health=$(curl -s -m 10 "$URL/health")
if [ $rc -eq 0 ] && [ -n "$REF" ] && [ "$got" = "$REF" ] && echo "$health" | grep -q '"status": *"ok"'; then
    ok "D1: ansible-playbook site.yml deployed the planned workers + serve over ssh in ${d1} s; /health ok; a completion equals --local 0's text"
else
    bad "D1: playbook rc $rc, health '$health', text '$got' vs '$REF': $(grep -E 'fatal|FAILED|msg' "$T/site1.log" | head -3 | cut -c1-300)"
    [ -n "${DEPLOY_HOLD:-}" ] || exit 1
fi
# the plan: the measured drives of both hosts, every layer once, one worker
# per host striped over its two drives by speed; then the endpoints, layer
# ranges and names the checks below use
plan_check=$(python3 - "$PLAN" "$T/stage/localhost/hosts.json" "$T" <<'EOF'
import json, sys
p, h, T = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
assert p["format"] == "k3shard-plan" and h["format"] == "k3shard-hosts", "formats"
assert [x["name"] for x in h["hosts"]] == ["depw1", "depw2"], "hosts %s" % [x["name"] for x in h["hosts"]]
for x in h["hosts"]:
    assert len(x["drives"]) == 2 and all(d["rand_gbs"] > 0 for d in x["drives"]), "unmeasured drive on " + x["name"]
    assert x["ram_gb"] > 0, "ram of " + x["name"]
    assert 0 < x["rtt_ms"] < 1000, "round trip to %s: %s ms (measured by plan.yml)" % (x["name"], x["rtt_ms"])
ws = p["workers"]
assert [w["name"] for w in ws] == ["depw1-w0", "depw2-w0"], "workers %s" % [w["name"] for w in ws]
got = [l for w in ws for l in range(w["layers"][0], w["layers"][1] + 1)]
assert got == list(range(p["n_layers"])), "layers %s" % got
bw = {d["path"]: d["rand_gbs"] for x in h["hosts"] for d in x["drives"]}
for w in ws:
    want = ["%s/hosts/%s/mnt/d%d" % (T, w["host"], k) for k in (0, 1)]
    assert [s["path"] for s in w["stripe"]] == want, "stripe %s" % w["stripe"]
    tot = sum(bw[q] for q in want)
    assert all(abs(s["weight"] - bw[s["path"]] / tot) < 1e-6 for s in w["stripe"]), "weights"
print(",".join(w["endpoint"] for w in ws))
print(" ".join("%s:%s:%s" % (w["name"], w["layers_arg"], w["endpoint"]) for w in ws))
print("%.3f:%.3f" % tuple(x["drives"][0]["rand_gbs"] + x["drives"][1]["rand_gbs"] for x in h["hosts"]))
print("/".join("%.3f" % x["rtt_ms"] for x in h["hosts"]))
EOF
)
if [ $? -eq 0 ]; then
    EPS=$(echo "$plan_check" | sed -n 1p)
    read -r -a WSPEC <<<"$(echo "$plan_check" | sed -n 2p)"
    ok "D1: the playbook's plan (plan --hosts from 4 drives measured on 2 hosts, $(echo "$plan_check" | sed -n 3p) GB/s per host, round trips $(echo "$plan_check" | sed -n 4p) ms measured from the coordinator host): ${WSPEC[*]}, each striped over its 2 drives"
else
    bad "D1: the plan: $plan_check"
    EPS=tcp://${ADDR[1]}:5555,tcp://${ADDR[2]}:5555
    WSPEC=(depw1-w0:0-4:x depw2-w0:4-8:x)
fi
NW=${#WSPEC[@]}
if grep -q "Unit verified\|Units verified" "$T/site1.log" && ! grep -q "no systemd-analyze" "$T/site1.log"; then
    ok "D1: k3-worker@.service and k3-coordinator.service pass systemd-analyze verify"
else
    skip "D1 systemd-analyze verify" "systemd-analyze not installed"
fi
nkeys=$(find "$T/hosts" -name '*.key' | wc -l)
keyhosts=$(for i in 0 1 2; do ls "$T/hosts/${HOSTS[$i]}/etc/k3/"*.key 2>/dev/null | wc -l; done | tr '\n' ' ')
if [ "$nkeys" -eq $((NW + 1)) ] && [ "$keyhosts" = "1 1 1 " ] && [ "$(stat -c %a "$CE/coord.key")" = 600 ]; then
    ok "D1: $nkeys key pairs, each secret only on its own host (per host: $keyhosts), mode 0600"
else
    bad "D1: secret keys: $nkeys in all, per host: $keyhosts"
fi

# ---- D2: idempotent ----
play site2.log site.yml
rc=$?
ch=$(recap_changed site2.log)
if [ $rc -eq 0 ] && [ "$ch" = 0 ]; then
    ok "D2: a second ansible-playbook run changes nothing (changed=0 on all 3 hosts)"
else
    bad "D2: second run rc $rc, changed=$ch: $(grep -B1 '^changed:' "$T/site2.log" | head -6 | tr '\n' ' ' | cut -c1-300)"
fi

# ---- D3: status ----
play status.log site.yml --tags status
rc=$?
status_cmd >"$T/status.txt" 2>&1
src=$?
rows=$(grep -c "  ok$" "$T/status.txt")
srows=0
for ws in "${WSPEC[@]}"; do # name:layers:endpoint: the plan's range, the real stripe (both drives' shares)
    IFS=: read -r wn wl _ <<<"$ws"
    grep -Eq " $wn +$wl +[^ ]*/mnt/d0:[0-9]+%,[^ ]*/mnt/d1:[0-9]+% " "$T/status.txt" && srows=$((srows + 1))
done
if [ $rc -eq 0 ] && [ $src -eq 0 ] && [ "$rows" -eq "$NW" ] && [ "$srows" -eq "$NW" ]; then
    ok "D3: status: $NW rows ok with the plan's layers and the placement's stripe (host, layers, stripe, build, GB/s, uptime, sessions, hit rate): $(sed -n 2p "$T/status.txt" | tr -s ' ' | cut -c1-200)"
else
    bad "D3: status rc $rc/$src, $rows ok rows, $srows with the plan's layers and stripe: $(cat "$T/status.txt" | head -5)"
fi

# ---- D4: logits through the deployed workers, bit-identical ----
IDS=5,7,9,11,300,2,77,1000,1200,3,4,5,6,7,8,9,10,11,12,13
"$C" --model "$TINY" --ids "$IDS" --ngen 6 --print-ids --threads 1 --local 0 --usage off \
    --all-logits "$T/ref.f32" >"$T/ref.out" 2>/dev/null
on 0 start-stop-daemon --stop --quiet --pidfile "$T/hosts/depc/run/k3/k3-coordinator.pid" \
    --remove-pidfile --retry TERM/10/KILL/5
on 0 "$CB/k3-coordinator" --model "$T/hosts/depc/var/lib/k3/model" --workers "$EPS" \
    --curve-secret "$CE/coord.key" --worker-keys "$CE/workers" --hb-ms 250 --threads 1 \
    --ids "$IDS" --ngen 6 --print-ids --all-logits "$T/d4.f32" >"$T/d4.out" 2>"$T/d4.err"
if cmp -s "$T/d4.f32" "$T/ref.f32" && cmp -s <(grep ids: "$T/d4.out") <(grep ids: "$T/ref.out"); then
    ok "D4: logits and ids through the $NW deployed workers (experts striped over 2 drives each) over CURVE are bit-identical to --local 0"
else
    bad "D4: logits differ: $(tail -2 "$T/d4.err")"
fi
play site3.log site.yml
rc=$?
got=$(complete d4)
if [ $rc -eq 0 ] && [ "$(recap_changed site3.log)" -eq 1 ] && [ "$got" = "$REF" ]; then
    ok "D4: re-running the playbook started the stopped coordinator again, its only change; it answers"
else
    bad "D4: playbook rc $rc after the coordinator stopped, text '$got'"
fi

# ---- D5: kill -9 a worker; the supervisor restarts it ----
sup=$(cat "$T/hosts/depw1/run/k3/k3-worker@w0.pid")
wpid=$(pgrep -P "$sup" | head -1)
kill -9 "$wpid"
t=$(date +%s.%N)
got=$(complete d5)
dt=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t}")
npid=$(pgrep -P "$sup" | head -1)
if [ -n "$wpid" ] && [ -n "$npid" ] && [ "$npid" != "$wpid" ] && [ "$got" = "$REF" ]; then
    ok "D5: kill -9 of depw1-w0 (pid $wpid): restarted by its supervisor (pid $npid); the request took ${dt} s and equals the reference"
else
    bad "D5: worker $wpid -> '$npid', text '$got' ($(cut -c1-200 "$T/d5.json"))"
fi
for _ in $(seq 40); do status_cmd >/dev/null 2>&1 && break; sleep 0.25; done

# ---- D6: DROP on depw2's link past the deadline, then restore ----
ip netns exec "$(ns 2)" iptables -I INPUT -j DROP
ip netns exec "$(ns 2)" iptables -I OUTPUT -j DROP
t=$(date +%s.%N)
complete d6a >/dev/null
dt=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t}")
err6=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["error"]["message"])' "$T/d6a.json" 2>/dev/null)
status_cmd --timeout-ms 1000 >"$T/status6.txt" 2>&1
ip netns exec "$(ns 2)" iptables -D INPUT -j DROP
ip netns exec "$(ns 2)" iptables -D OUTPUT -j DROP
for _ in $(seq 60); do status_cmd >/dev/null 2>&1 && break; sleep 0.25; done
got=$(complete d6b)
n2=$(printf '%s\n' "${WSPEC[@]}" | grep -c "^depw2-")
if [ -n "$err6" ] && [ "$(grep -c "^${ADDR[2]}:55[0-9][0-9] .*down: no answer" "$T/status6.txt")" -eq "$n2" ] && [ "$got" = "$REF" ]; then
    ok "D6: DROP on depw2's link: the request failed in ${dt} s with '$(echo "$err6" | cut -c1-110)'; status said its $n2 worker(s) down; after the restore the text equals the reference"
else
    bad "D6: during: '$err6' ($(cut -c1-200 "$T/d6a.json")); status: $(grep "^${ADDR[2]}:" "$T/status6.txt" | head -1 | cut -c1-160); after: '$got'"
fi

# ---- D7: rolling restart while a client asks ----
(
    n=0 e=0
    while [ ! -f "$T/d7.stop" ]; do
        g=$(complete d7c)
        n=$((n + 1))
        [ "$g" = "$REF" ] || e=$((e + 1))
    done
    echo "$n $e" >"$T/d7.res"
) &
cpid=$!
play roll.log rolling-restart.yml
rc=$?
touch "$T/d7.stop"
wait $cpid
read -r n7 e7 <"$T/d7.res"
if [ $rc -eq 0 ] && [ "$n7" -ge 1 ] && [ "$e7" -eq 0 ] && status_cmd >/dev/null 2>&1; then
    ok "D7: rolling-restart.yml restarted both worker hosts one at a time; $n7 client requests during it, 0 errors"
else
    bad "D7: rolling restart rc $rc, $e7 of $n7 requests failed: $(grep -E 'fatal|msg' "$T/roll.log" | head -2 | cut -c1-200)"
fi

# ---- D8: another build identity, an unknown coordinator key ----
W2E=$T/hosts/depw2/etc/k3
IFS=: read -r _ w2l _ <<<"${WSPEC[$((NW - 1))]}" # depw2's worker: its layers are on its d0
on_bg 2 "K3_WORKER_FAULT=build=k3shard-other-build" "$T/hosts/depw2/opt/k3shard/bin/k3-worker" \
    --model "$T/hosts/depw2/var/lib/k3/model" --dirs "$T/hosts/depw2/mnt/d0/k3" --layers "$w2l" \
    --listen "tcp://${ADDR[2]}:5599" --curve-secret "$W2E/depw2-w0.key" --allow "$W2E/coordinators" \
    --name odd --threads 1 --no-bench </dev/null >"$T/odd.log" 2>&1
printf 'tcp://%s:5599 %s\n' "${ADDR[2]}" "$(sed -n 's/^public = //p' "$W2E/depw2-w0.pub")" >"$CE/odd.keys"
for _ in $(seq 40); do grep -q serving "$T/odd.log" && break; sleep 0.1; done
on 0 "$CB/k3-coordinator" status --workers "tcp://${ADDR[2]}:5599" --curve-secret "$CE/coord.key" \
    --worker-keys "$CE/odd.keys" >"$T/odd.status" 2>&1
rc=$?
on 0 timeout 30 "$CB/k3-coordinator" --model "$T/hosts/depc/var/lib/k3/model" \
    --workers "tcp://${ADDR[2]}:5599" --curve-secret "$CE/coord.key" --worker-keys "$CE/odd.keys" \
    --ids 5,7 --ngen 1 --threads 1 >/dev/null 2>"$T/odd.coord" </dev/null
rc2=$?
if [ $rc -eq 1 ] && grep -q "refused: build identity mismatch: coordinator 'k3shard proto .* rev .*', worker 'k3shard-other-build'" "$T/odd.status" &&
    [ $rc2 -ne 0 ] && [ $rc2 -ne 124 ] && grep -q "build identity mismatch: coordinator '.*', worker 'k3shard-other-build'" "$T/odd.coord"; then
    ok "D8: a worker of another build: the coordinator is refused naming both builds; status says '$(grep -o 'refused: build.*' "$T/odd.status" | cut -c1-110)'"
else
    bad "D8: other build: status rc $rc: $(tail -1 "$T/odd.status" | cut -c1-200); coordinator rc $rc2: $(grep -v '^\[' "$T/odd.coord" | tail -1)"
fi
on 0 "$CB/k3-coordinator" keygen "$T/hosts/depc/etc/k3/intruder" >/dev/null 2>&1
status_cmd >/dev/null 2>&1 # warm
on 0 "$CB/k3-coordinator" status --workers "$EPS" --curve-secret "$CE/intruder.key" \
    --worker-keys "$CE/workers" >"$T/intruder.status" 2>&1
rc=$?
if [ $rc -eq 1 ] && [ "$(grep -c "refused: cannot authenticate: the worker refused" "$T/intruder.status")" -eq "$NW" ]; then
    ok "D8: an unknown coordinator key: every worker refuses it, status says '$(grep -o 'refused: cannot.*' "$T/intruder.status" | head -1 | cut -c1-100)'"
else
    bad "D8: unknown key: rc $rc: $(sed -n 2p "$T/intruder.status")"
fi
got=$(complete d8)
[ "$got" = "$REF" ] && ok "D8: the probes left serve untouched: a completion still equals the reference" ||
    bad "D8: serve after the probes: '$got'"

# ---- D9: CURVE on the wire ----
# the envelope's msgpack keys ("pos0", "sess") and the embedding row of the
# prompt's first token would be in a plain capture
# tcpdump says "listening on" once it captures: under load that takes more
# than the half second a short run lasts, so each capture waits for it
capture() { # file filter...: starts tcpdump on host 1's eth0, tpid its pid
    local f=$1
    shift
    : >"$f.err"
    ip netns exec "$(ns 1)" tcpdump -i eth0 -w "$f" -U "$@" >/dev/null 2>"$f.err" &
    tpid=$!
    for _ in $(seq 100); do grep -q 'listening on' "$f.err" && break; sleep 0.1; done
    sleep 0.5
}
capture "$T/curve.pcap" tcp
complete d9 >/dev/null
sleep 1
kill "$tpid"
wait "$tpid" 2>/dev/null
plain_in() { python3 - "$1" <<'EOF'
import sys
b = open(sys.argv[1], "rb").read()
print(len(b), int(b"pos0" in b or b"\xa4sess" in b))
EOF
}
read -r cbytes cplain < <(plain_in "$T/curve.pcap")
# the control: a plain --insecure worker pair across the same veth
on_bg 1 "$T/hosts/depw1/opt/k3shard/bin/k3-worker" --model "$TINY" --layers 0-8 \
    --listen "tcp://${ADDR[1]}:5590" --insecure --threads 1 --no-bench </dev/null >"$T/plain_w.log" 2>&1
for _ in $(seq 40); do grep -q serving "$T/plain_w.log" && break; sleep 0.1; done
capture "$T/plain.pcap" tcp port 5590
on 0 "$CB/k3-coordinator" --model "$T/hosts/depc/var/lib/k3/model" --workers "tcp://${ADDR[1]}:5590" \
    --insecure --ids 5,7,9 --ngen 2 --threads 1 >/dev/null 2>&1
sleep 1
kill "$tpid"
wait "$tpid" 2>/dev/null
read -r pbytes pplain < <(plain_in "$T/plain.pcap")
if [ "$cbytes" -gt 10000 ] && [ "$cplain" = 0 ] && [ "$pplain" = 1 ]; then
    ok "D9: tcpdump on depw1's veth: $cbytes bytes of CURVE traffic, no plaintext envelope key; the --insecure control capture ($pbytes bytes) shows them"
else
    bad "D9: curve capture $cbytes bytes, plaintext $cplain; control $pbytes bytes, plaintext $pplain"
fi

# ---- D10: plain tcp off loopback ----
on 1 "$T/hosts/depw1/opt/k3shard/bin/k3-worker" --model "$TINY" --layers 0-8 \
    --listen "tcp://${ADDR[1]}:5591" --no-bench >"$T/plain_refused.log" 2>&1 </dev/null
rc=$?
on 0 "$CB/k3-coordinator" --model "$T/hosts/depc/var/lib/k3/model" --workers "tcp://${ADDR[1]}:5590" \
    --ids 5,7 --ngen 1 >/dev/null 2>"$T/plain_coord.err" </dev/null
rc2=$?
if [ $rc -ne 0 ] && grep -q "needs CURVE" "$T/plain_refused.log" && [ $rc2 -ne 0 ] &&
    grep -q "needs CURVE" "$T/plain_coord.err" && [ "$pplain" = 1 ]; then
    ok "D10: plain tcp off loopback refused by worker and coordinator; with --insecure it runs (D9's control)"
else
    bad "D10: plain tcp: worker rc $rc, coordinator rc $rc2: $(tail -1 "$T/plain_refused.log")"
fi

echo "# test_deploy_cluster: $(($(date +%s) - T0)) s"
if [ -n "${DEPLOY_HOLD:-}" ]; then # debugging: keep the hosts until $T/release exists
    echo "$T" >"$DEPLOY_HOLD"
    while [ ! -f "$T/release" ]; do sleep 1; done
fi
exit $fail
