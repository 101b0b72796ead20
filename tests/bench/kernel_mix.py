#!/usr/bin/python3
"""tests/bench/kernel_mix.py: the instruction mix of the AVX-512 n = 1 tiles'
hot loops, read from the built object (issue 7's profile where `perf` has no
PMU and valgrind no AVX-512). Run by kernel-mix.sh.

For each tile it disassembles the function (objdump), takes its hot loop
(the backward conditional branch spanning the most vector instructions,
less the loops nested in it), and counts the loop's instructions in the
classes that pipe_probe measures:
  mul    vpdpbusd, FMA, vmulps ...: one multiply unit, 1 zmm per cycle
  shuf   shuffles, permutes, shifts, widening, conversions: 1 zmm per cycle
         of one kind, 1.5 of two kinds mixed
  alu    vpaddd, vpand, vaddps ...: any vector pipe
  load   vector loads, prefetches, and memory operands of the above
  (register-to-register moves are eliminated at rename: not counted)
Every zmm instruction also takes one of the 2 zmm issue slots per cycle.
With the weight bytes one iteration reads, that gives a lower bound on
cycles per 64 bytes: max(mul, shuf / 1.5, (mul + shuf + alu) / 2), and the
rate it allows at CLOCK GHz (the measured 1-per-cycle rate of vfmadd231ps).
A bound, not a prediction: latencies, the front end and memory come on top.

Usage: kernel_mix.py OBJECT CLOCK_GHZ
       kernel_mix.py --check OBJECT   (TAP lines: each tile's loop is found
       and holds its designed count of the key instruction)
"""
import re
import subprocess
import sys

# tile function -> (what it is, weight bytes per iteration of its hot loop,
# the designed count of its key instruction per iteration, for --check)
TILES = [
    ("zi4_4_1", "int4 float, n = 1 (4 rows x 64 B per step)", 256, ("vpdpbusd", 24)),
    ("zq8_4_1", "int8 float, n = 1 (4 rows x 16 B per step)", 64, ("vfmadd231ps", 4)),
    ("zvmxb_1", "MXFP4 integer-dot, n = 1 (16 rows x 64 B)", 1024, ("vpdpbusd", 32)),
    ("zvi4b_1", "int4 integer-dot, n = 1 (16 rows x 64 B)", 1024, ("vpdpbusd", 32)),
]

MUL = re.compile(r"^v(pdpbus|pdpwss|f[n]?m(add|sub)|mulp|pmaddubsw|pmaddwd|pmull)")
SHUF = re.compile(r"^v(perm|punpck|shuf|pshuf|psrl|psll|psra|cvt|insert|extract|pmov[sz]x|"
                  r"pmov[^m]|broadcast|align|palignr|pack|pbroadcast|expand|compress|"
                  r"gf2p8|pmultishift)")
ALU = re.compile(r"^v(padd|psub|pand|por|pxor|pternlog|addp|subp|maxp|minp|pmax|pmin|blend|"
                 r"pblend|pcmp|cmp|xorp|andp|orp)")
LINE = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
JUMP = re.compile(r"^j(?!mp)[a-z]+$")  # conditional: a loop's back edge


def disasm(obj, fn):
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--disassemble={fn}", obj],
                         capture_output=True, text=True, check=True).stdout
    ins = []
    for line in out.splitlines():
        m = LINE.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return ins


def classify(mn, ops):
    """-> (class or None, memory operands read)"""
    mem = 1 if "(" in ops else 0
    if mn.startswith("prefetch"):
        return "load", 1
    if not mn.startswith("v"):
        return None, 0
    if mn.startswith("vmov"):
        # AT&T: the destination is last; a memory destination is a store
        dst = ops.rsplit(",", 1)[-1]
        if "(" in dst:
            return "store", 0
        # register to register: eliminated at rename (pipe_probe: 4 per
        # cycle next to vpaddd's 2), so no pipe
        return ("load", 1) if mem else ("move", 0)
    for name, rx in (("mul", MUL), ("shuf", SHUF), ("alu", ALU)):
        if rx.match(mn):
            return name, mem
    return "alu", mem


def hot_loop(ins):
    """the backward conditional branch whose body holds the most vector
    instructions (a backward jmp is GCC's return from an out-of-line block
    into the loop, not a loop)"""
    best, addr_index = None, {a: i for i, (a, _, _) in enumerate(ins)}
    for i, (_, mn, ops) in enumerate(ins):
        if not JUMP.match(mn):
            continue
        t = ops.split()[0] if ops else ""
        try:
            target = int(t, 16)
        except ValueError:
            continue
        if target not in addr_index or addr_index[target] > i:
            continue
        body = ins[addr_index[target]:i + 1]
        nvec = sum(1 for _, m, _ in body if m.startswith("v"))
        if best is None or nvec > best[0]:
            best = (nvec, body)
    if not best:
        return []
    # without the bodies of loops nested in it (zv_tile's factor transposes,
    # which run once per 16 steps)
    body = best[1]
    lo, hi = body[0][0], body[-1][0]
    inner = []
    for a, mn, ops in body[:-1]:
        if JUMP.match(mn) and ops:
            try:
                t = int(ops.split()[0], 16)
            except ValueError:
                continue
            if lo < t <= a:
                inner.append((t, a))
    return [x for x in body if not any(t <= x[0] <= a for t, a in inner)]


def check(obj):
    bad = 0
    for fn, _, _, (key, want) in TILES:
        got = sum(1 for _, mn, _ in hot_loop(disasm(obj, fn)) if mn == key)
        ok = got == want
        bad += not ok
        print(f"{'ok' if ok else 'not ok'} - kernel_mix: {fn}'s hot loop holds {got} {key} "
              f"(designed: {want})")
    return 1 if bad else 0


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        return check(sys.argv[2])
    if len(sys.argv) != 3:
        sys.stderr.write(__doc__.split("\n\n")[-1] + "\n")
        return 2
    obj, ghz = sys.argv[1], float(sys.argv[2])
    print(f"# hot-loop instruction mix per 64 weight bytes, {obj}; bound at {ghz:.2f} GHz")
    print(f"{'tile':8} {'mul':>5} {'shuf':>5} {'alu':>5} {'load':>5} {'scal':>5} "
          f"{'cyc>=':>6} {'GB/s<=':>7}  kernel")
    for fn, what, step, _ in TILES:
        ins = disasm(obj, fn)
        if not ins:
            print(f"{fn:8} not in {obj}")
            continue
        body = hot_loop(ins)
        n = {"mul": 0, "shuf": 0, "alu": 0, "move": 0, "load": 0, "store": 0, "scal": 0}
        for _, mn, ops in body:
            c, mem = classify(mn, ops)
            if c is None:
                n["scal"] += 1
                continue
            n[c] += 1
            if c not in ("load", "store", "move"):
                n["load"] += mem
        per = {k: v * 64.0 / step for k, v in n.items()}
        cyc = max(per["mul"], per["shuf"] / 1.5, (per["mul"] + per["shuf"] + per["alu"]) / 2)
        print(f"{fn:8} {per['mul']:5.1f} {per['shuf']:5.1f} {per['alu']:5.1f} {per['load']:5.1f} "
              f"{per['scal']:5.1f} {cyc:6.2f} {64 * ghz / cyc:7.1f}  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
