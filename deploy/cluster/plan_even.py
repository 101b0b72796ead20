#!/usr/bin/env python3
"""deploy/cluster/plan_even.py: the even layer split the playbook uses until
`k3-coordinator plan --hosts INVENTORY` (docs/DEPLOY.md, "Small cluster") can
write per-host assignments from measured drive speeds.

Reads on stdin the worker instances in inventory order, a JSON list of
{"host": H, "drive": I, "name": N}, and the model directory (--model) on the
control node. Prints one JSON object:
  {"n_layers": L,
   "global": [{"name": F, "size": BYTES}, ...],   every host gets these
   "instances": [{"host", "drive", "name", "layers": [a, b),
                  "files": [{"name", "size"}, ...]}, ...]}
Layers are split in order, each instance getting floor(L / n) and the first
L mod n one more. An instance's files are the shards that hold its layers
(model.safetensors.index.json); "global" is every other file of the model
directory (config, index, tokenizer, the embedding/head shard): small next
to the layer shards, so every host gets a copy. Errors go to stderr with
exit status 1: no index, more instances than layers, a layer split across
shards that two instances would both need (named).
"""
import argparse
import json
import os
import re
import sys


def fail(msg):
    sys.stderr.write("plan_even.py: %s\n" % msg)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model directory on the control node")
    a = ap.parse_args()
    try:
        inst = json.load(sys.stdin)
    except ValueError as e:
        fail("instances on stdin: %s" % e)
    cfg_path = os.path.join(a.model, "config.json")
    idx_path = os.path.join(a.model, "model.safetensors.index.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
        with open(idx_path) as f:
            wmap = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError) as e:
        fail("%s: %s" % (a.model, e))
    cfg = cfg.get("text_config", cfg)
    L = int(cfg["num_hidden_layers"])
    n = len(inst)
    if n == 0 or n > L:
        fail("%d worker instances for %d layers: need 1..%d" % (n, L, L))
    # layer -> shard files
    by_layer = {}
    layer_files = set()
    pat = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    for name, fname in wmap.items():
        m = pat.search(name)
        if m:
            by_layer.setdefault(int(m.group(1)), set()).add(fname)
            layer_files.add(fname)
    size = lambda f: os.path.getsize(os.path.join(a.model, f))
    out, first = [], 0
    owner = {}
    for i, it in enumerate(inst):
        k = L // n + (1 if i < L % n else 0)
        files = sorted(set().union(*[by_layer.get(l, set()) for l in range(first, first + k)]))
        for f in files:
            if f in owner and owner[f] != it["name"]:
                fail("shard %s holds layers of both %s and %s: repack one shard per layer range"
                     % (f, owner[f], it["name"]))
            owner[f] = it["name"]
        out.append(dict(it, layers=[first, first + k],
                        files=[{"name": f, "size": size(f)} for f in files]))
        first += k
    # dot files are run state (.k3_usage, the expert usage history), not checkpoint
    glob = sorted(f for f in os.listdir(a.model)
                  if os.path.isfile(os.path.join(a.model, f)) and f not in layer_files
                  and not f.startswith("."))
    json.dump({"n_layers": L, "global": [{"name": f, "size": size(f)} for f in glob],
               "instances": out}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
