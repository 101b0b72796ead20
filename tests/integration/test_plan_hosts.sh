#!/usr/bin/env bash
# tests/integration/test_plan_hosts.sh: `k3-coordinator plan --hosts` and
# `--describe` (docs/DEPLOY.md "The commands", coordinator/plan_hosts.h) on
# tiny with given drive speeds: one worker per (host, NUMA node), each
# worker's expert bytes within one layer's worth of its speed share, each
# drive's share its speed within its worker exactly, endpoints, shard files
# and the budget cap; the hosts file's errors named; --describe's entry.
#  H1 the split, stripes, endpoints and names
#  H2 each worker's files hold its layers' tensors, "global" the rest
#  H3 RAM: a small host caches less; the prediction adds the round trips
#  H4 refused: an unmeasurable drive, a host twice, --drives with --hosts
#  H5 --describe writes a host entry with the drives measured
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C"
make_tmp plan_hosts
PY=/usr/bin/python3
cat >"$T/hosts.json" <<EOF
{"format": "k3shard-hosts", "version": 1, "hosts": [
 {"name": "a", "addr": "10.1.0.2", "ram_gb": 0.0004, "rtt_ms": 0.5,
  "drives": [{"path": "/mnt/a0", "rand_gbs": 1.0}, {"path": "/mnt/a1", "rand_gbs": 3.0}]},
 {"name": "b", "addr": "10.1.0.3", "port": 6000, "rtt_ms": 1.5,
  "drives": [{"path": "/mnt/b0", "numa": 0, "rand_gbs": 2.0}, {"path": "/mnt/b1", "numa": 1, "rand_gbs": 2.0}]}]}
EOF
if "$C" plan --model "$TINY" --hosts "$T/hosts.json" --ram 1 --out "$T/plan.json" >"$T/plan.out" 2>"$T/plan.err"; then
    res=$($PY - "$T/plan.json" "$TINY" <<'EOF' 2>&1
import json, sys, re
p, tiny = json.load(open(sys.argv[1])), sys.argv[2]
ws = p["workers"]
names = [w["name"] for w in ws]
assert names == ["a-w0", "b-w0", "b-w1"], "workers %s" % names
assert [w["endpoint"] for w in ws] == ["tcp://10.1.0.2:5555", "tcp://10.1.0.3:6000", "tcp://10.1.0.3:6001"], "endpoints"
assert [w["numa"] for w in ws] == [-1, 0, 1], "numa"
layers = [l for w in ws for l in range(w["layers"][0], w["layers"][1] + 1)]
assert layers == list(range(p["n_layers"])), "layers %s" % layers
for w in ws:
    a, b = map(int, w["layers_arg"].split("-"))
    assert (a, b) == (w["layers"][0], w["layers"][1] + 1), "layers_arg " + w["layers_arg"]
# H1: expert bytes follow speed within one layer's worth; stripes exact
bw = [4.0, 2.0, 2.0]
eb = [w["expert_gb"] for w in ws]
cfg = json.load(open(tiny + "/config.json")); cfg = cfg.get("text_config", cfg)
per_layer = sum(eb) / sum(1 for l in range(p["n_layers"]) if l >= cfg.get("first_k_dense_replace", 0))
worst = max(abs(e / sum(eb) - x / sum(bw)) for e, x in zip(eb, bw))
assert worst <= per_layer / sum(eb) + 1e-9, "shares %s vs %s" % (eb, bw)
st = ws[0]["stripe"]
assert [s["path"] for s in st] == ["/mnt/a0", "/mnt/a1"] and abs(st[0]["weight"] - 0.25) < 1e-9 and abs(st[1]["weight"] - 0.75) < 1e-9, "stripe %s" % st
sh = {d["path"]: d["share"] for d in p["drives"]}
assert abs(sh["/mnt/a1"] - 3 * sh["/mnt/a0"]) < 1e-9 and abs(sum(sh.values()) - 1) < 1e-9, "drive shares %s" % sh
print("H1 %s expert GB %s for speeds 4:2:2 (worst %.1f%% off, one layer is %.1f%%)" % (
    " ".join("%s=%s" % (w["name"], w["layers_arg"]) for w in ws), "/".join("%.5f" % e for e in eb),
    100 * worst, 100 * per_layer / sum(eb)))
# H2: files
idx = json.load(open(tiny + "/model.safetensors.index.json"))["weight_map"]
glob = {f["name"] for f in p["global"]}
for w in ws:
    files = {f["name"] for f in w["files"]}
    want = {fn for k, fn in idx.items() if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", k))
            and w["layers"][0] <= int(m.group(1)) <= w["layers"][1]}
    assert files == want, "%s files %s want %s" % (w["name"], files, want)
    assert not files & glob, "layer shards in global"
assert {"config.json", "model.safetensors.index.json", "tiktoken.model"} <= glob, "global %s" % glob
assert not any(f.startswith(".") for f in glob), "dot files in global"
print("H2 %d global files; worker files = the shards of their layers" % len(glob))
# H3: host a (0.0011 GB) caches less than its experts; b capped at its experts
a, b0 = ws[0], ws[1]
assert a["cache_gb"] < a["expert_gb"] and a["cache_gb"] <= 0.0004 * 0.9, "a cache %g of %g" % (a["cache_gb"], a["expert_gb"])
assert abs(b0["cache_gb"] - b0["expert_gb"]) < 1e-12, "b cache %g vs experts %g" % (b0["cache_gb"], b0["expert_gb"])
assert p["predicted_s_per_token"] >= (0.5 + 1.5 + 1.5) / 1e3, "prediction %g" % p["predicted_s_per_token"]
print("H3 cache a %.6f of %.6f GB (0.0004 GB RAM), b capped at its experts %.6f GB; predicted %.6f s/token >= 3.5 ms of round trips" % (
    a["cache_gb"], a["expert_gb"], b0["expert_gb"], p["predicted_s_per_token"]))
EOF
)
    if [ $? -eq 0 ]; then
        echo "$res" | while read -r h rest; do ok "$h: $rest"; done
    else
        bad "H1-H3: $res"
    fi
else
    bad "H1: plan --hosts failed: $(tail -2 "$T/plan.err")"
fi

# H4: refusals, each naming what is wrong
sed 's#"path": "/mnt/b1", "numa": 1, "rand_gbs": 2.0#"path": "/nonexistent/b1"#' "$T/hosts.json" >"$T/h_unmeasured.json"
sed 's#"name": "b"#"name": "a"#' "$T/hosts.json" >"$T/h_twice.json"
"$C" plan --model "$TINY" --hosts "$T/h_unmeasured.json" --ram 1 --out "$T/x.json" >/dev/null 2>"$T/e1"
r1=$?
"$C" plan --model "$TINY" --hosts "$T/h_twice.json" --ram 1 --out "$T/x.json" >/dev/null 2>"$T/e2"
r2=$?
"$C" plan --model "$TINY" --hosts "$T/hosts.json" --drives /tmp --out "$T/x.json" >/dev/null 2>"$T/e3"
r3=$?
if [ $r1 = 1 ] && grep -q "host b drive /nonexistent/b1: no rand_gbs given and not measurable here" "$T/e1" &&
    [ $r2 = 1 ] && grep -q "host a listed twice" "$T/e2" && [ $r3 = 2 ] && grep -q "not both" "$T/e3"; then
    ok "H4: refused naming the cause: '$(cut -c1-120 "$T/e1")', '$(cat "$T/e2")', and --drives with --hosts (usage)"
else
    bad "H4: rc $r1/$r2/$r3: $(cat "$T/e1" "$T/e2" "$T/e3" | tr '\n' ' ' | cut -c1-300)"
fi

# H5: --describe on two local directories (a short measurement)
mkdir -p "$T/d0" "$T/d1"
if "$C" plan --describe me --drives "$T/d0,$T/d1" --seconds 0.2 --ram 12.5 --out - >"$T/me.json" 2>"$T/me.err" &&
    $PY - "$T/me.json" "$T" <<'EOF'; then
import json, sys
d, T = json.load(open(sys.argv[1])), sys.argv[2]
assert d["format"] == "k3shard-host" and d["name"] == "me" and d["ram_gb"] == 12.5, d
assert [x["path"] for x in d["drives"]] == [T + "/d0", T + "/d1"], d["drives"]
assert all(x["rand_gbs"] > 0 and x["seq_gbs"] > 0 for x in d["drives"]), d["drives"]
EOF
    ok "H5: --describe wrote the host entry with both drives measured ($(grep -o '"rand_gbs": [0-9.]*' "$T/me.json" | head -1))"
else
    bad "H5: --describe: $(tail -2 "$T/me.err") $(head -c 300 "$T/me.json")"
fi
exit $fail
