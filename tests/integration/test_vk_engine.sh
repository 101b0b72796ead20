#!/usr/bin/env bash
# tests/integration/test_vk_engine.sh: the Vulkan expert tier in a run
# (docs/VULKAN.md; common/vk/vk_tier.h, the hook in common/layers/moe.c), on
# whatever Vulkan device is here (Mesa's lavapipe in `make test`).
#  - with --vk --exact the generated ids and the logits of every prompt
#    position are the CPU --exact run's, byte for byte (so their argmax too),
#    with a tier budget that holds every expert, a few (evictions and
#    promotions) and one; in-process and with --local 2 workers; through
#    --vk flags and through COLI_VULKAN / K3_VK, COLI_VK_TIER_GB / K3_VK_GB;
#  - fallback: no Vulkan driver (VK_ICD_FILENAMES pointing at nothing), a
#    device index that does not exist, an upload failure and a device call
#    failure injected mid-run (K3_TEST_VK_FAIL_UPLOAD / _APPLY): a message
#    naming the cause, the CPU computes, the same bytes;
#  - --vk without --exact says that tokens may then differ; the device's own
#    fma() (K3_VK_FMA=native, as on a device without shaderFloat64) says so.
#  - stats: --local 2 --stats sums FORWARD_DONE's per-step vk_* figures per
#    stage, equal to each worker's STATS_OK totals; a cluster coordinator's
#    serve /metrics has the tier's families per stage.
set -u
. "$(dirname "$0")/../lib.sh"
need_bins "$C" "$W"
make_tmp k3vk
export K3_LOG=info
unset K3_VK K3_VK_GB COLI_VULKAN COLI_VK_TIER_GB K3_VK_DEVICE K3_USAGE COLI_USAGE
unset K3_TEST_VK_FAIL_UPLOAD K3_TEST_VK_FAIL_APPLY K3_VK_FMA
export XDG_CACHE_HOME="$T/cache"
unset K3_CACHE_DIR # it would win over XDG_CACHE_HOME (tests/run.sh sets one per run)

if ! "$C" --help | grep -q -- "--vk-gb"; then
    bad "--help lists --vk, --vk-device, --vk-gb"
fi
ok "--help lists the tier's options"
# a build without Vulkan says so and runs on the CPU: nothing more to check
probe=$("$C" --model "$TINY" --local 0 --usage off --ids 5 --ngen 1 --vk 2>&1 >/dev/null)
if echo "$probe" | grep -q "unavailable: this build had no glslc"; then
    ok "a build without Vulkan says --vk is unavailable and runs on the CPU"
    skip "Vulkan tier in a run" "this build has no Vulkan (glslc, libvulkan-dev)"
    exit 0
fi
if echo "$probe" | grep -q "tier is off"; then
    skip "Vulkan tier in a run" "no Vulkan device here: $(echo "$probe" | grep 'tier is off' | head -1)"
    exit 0
fi

# one expert of tiny on the device: 3 * (32*32/2 + 32*32/32) bytes
EB=1632
GB_ALL=0.001          # every expert of the 7 MoE layers (112 * 1632 B)
GB_FEW=0.00001        # 6 experts
GB_ONE=0.000002       # 1 expert
P1=5,17,200,33,901,44,12,7,300,301,302,1000,64,65,66,67
P2=1280,9,9,9,400,401,402,403
HIST="$T/hist"

run() { # name args...: logits of both prompts in $T/name.{1,2}.f32, ids in .ids
    local name=$1; shift
    local rc=0 i=1 p
    : >"$T/$name.ids"
    : >"$T/$name.err"
    for p in "$P1" "$P2"; do
        "$C" --model "$TINY" --exact --ids "$p" --ngen 8 --print-ids --stats --threads 2 \
            --all-logits "$T/$name.$i.f32" "$@" >"$T/$name.$i.out" 2>>"$T/$name.err" || rc=$?
        grep '^ids:' "$T/$name.$i.out" >>"$T/$name.ids"
        i=$((i + 1))
    done
    return $rc
}
same() { # a b: both prompts' logits and ids byte-identical
    cmp -s "$T/$1.1.f32" "$T/$2.1.f32" && cmp -s "$T/$1.2.f32" "$T/$2.2.f32" &&
        cmp -s "$T/$1.ids" "$T/$2.ids" && [ "$(wc -l <"$T/$1.ids")" -eq 2 ]
}
stat() { # name key: the number before KEY in the last vulkan stats line
    grep '^stats: vulkan' "$T/$1.err" | tail -1 | grep -o "[0-9]* $2" | head -1 | cut -d' ' -f1
}
vkline() { grep '^stats: vulkan' "$T/$1.err" | tail -1; }

# a short history for the tier to fill from (another prompt: the runs'
# own experts then overtake the filled ones, so the few-experts budget
# promotes and evicts)
"$C" --model "$TINY" --local 0 --exact --ids 100,200,300 --ngen 2 --usage "$HIST" \
    >"$T/hist.out" 2>"$T/hist.err"
[ -s "$HIST" ] && ok "usage history written ($(wc -l <"$HIST") lines)" ||
    bad "usage history: $(tail -2 "$T/hist.err")"
# the CPU reference
if run cpu --local 0 --usage off; then
    ok "CPU --exact run"
else
    bad "CPU --exact run: $(tail -2 "$T/cpu.err")"
fi
export K3_USAGE_SAVE=0 # the tier runs read the history, never change it

for case in all:$GB_ALL few:$GB_FEW one:$GB_ONE; do
    n=${case%%:*} gb=${case#*:}
    run "vk_$n" --local 0 --usage "$HIST" --vk --vk-gb "$gb"
    rc=$?
    calls=$(stat "vk_$n" "device expert calls")
    filled=$(stat "vk_$n" filled)
    if [ "$rc" -eq 0 ] && same cpu "vk_$n" && [ "${calls:-0}" -gt 0 ]; then
        ok "--vk --exact, budget $n ($gb GB): ids and logits of every position = the CPU's ($(vkline "vk_$n" | cut -c1-160)...)"
    else
        bad "--vk --exact, budget $n: rc $rc, same: $(same cpu "vk_$n" && echo y || echo n), $(vkline "vk_$n") $(grep -i 'warn\|error' "$T/vk_$n.err" | head -3)"
    fi
    res=$(stat "vk_$n" "resident")
    case $n in
    all) [ "${filled:-0}" -gt 6 ] && [ "$(stat vk_all evictions)" = 0 ] &&
        ok "budget all: filled from the history hottest first ($filled), no eviction" ||
        bad "budget all: filled ${filled:-?}, evictions $(stat vk_all evictions)" ;;
    few) ev=$(stat vk_few evictions) pr=$(stat vk_few promotions)
        [ "${filled:-0}" -eq 6 ] && [ "${ev:-0}" -gt 0 ] && [ "${pr:-0}" -gt 0 ] && [ "${res:-0}" -le 6 ] &&
        ok "budget few: 6 filled, $pr promotions, $ev evictions, $res resident" ||
        bad "budget few: filled ${filled:-?}, promotions ${pr:-?}, evictions ${ev:-?}, resident ${res:-?}" ;;
    one) [ "${res:-0}" -eq 1 ] && [ "${filled:-0}" -eq 1 ] &&
        ok "budget one: one expert resident, $(stat vk_one evictions) evictions" ||
        bad "budget one: resident ${res:-?}, filled ${filled:-?}" ;;
    esac
done

# the seed's variable names, without flags
COLI_VULKAN=1 COLI_VK_TIER_GB=$GB_FEW run env_coli --local 0 --usage "$HIST"
if same cpu env_coli && [ "$(stat env_coli filled)" = 6 ]; then
    ok "COLI_VULKAN=1 COLI_VK_TIER_GB=$GB_FEW: the tier with that budget, same bytes"
else
    bad "COLI_VULKAN / COLI_VK_TIER_GB: $(vkline env_coli)"
fi
K3_VK=1 K3_VK_GB=$GB_ONE run env_k3 --local 0 --usage "$HIST"
if same cpu env_k3 && [ "$(stat env_k3 resident)" = 1 ]; then
    ok "K3_VK=1 K3_VK_GB=$GB_ONE: the old names work as aliases, same bytes"
else
    bad "K3_VK / K3_VK_GB: $(vkline env_k3)"
fi
COLI_VULKAN=0 K3_VK=1 run env_off --local 0 --usage "$HIST"
if same cpu env_off && ! grep -q '^stats: vulkan' "$T/env_off.err"; then
    ok "COLI_VULKAN=0 beats K3_VK=1: no tier"
else
    bad "COLI_VULKAN=0 with K3_VK=1: $(vkline env_off)"
fi

# two local workers, each with its own tier (half the budget each)
run cpu_l2 --local 2 --usage "$HIST"
run vk_l2 --local 2 --usage "$HIST" --vk --vk-gb "$GB_FEW"
nvk=$(grep -c '\[VK\] tier on .*: [1-9][0-9]* expert calls' "$T/vk_l2.err")
if same cpu vk_l2 && same cpu_l2 vk_l2 && [ "$nvk" -ge 2 ]; then
    ok "--local 2 --vk --exact: same bytes as the CPU, both workers' tiers computed ($nvk [VK] lines)"
else
    bad "--local 2 --vk: same as CPU: $(same cpu vk_l2 && echo y || echo n), [VK] lines with calls $nvk: $(grep '\[VK\]\|vulkan' "$T/vk_l2.err" | head -4)"
fi

if grep -q '^  stage 0 vulkan: [1-9][0-9]* device expert calls' "$T/vk_l2.err" &&
    grep -q '^  stage 1 vulkan: [1-9][0-9]* device expert calls' "$T/vk_l2.err"; then
    ok "--local 2 --stats: each worker's tier from STATS_OK ($(grep -m1 '^  stage 0 vulkan' "$T/vk_l2.err" | cut -c3-90)...)"
else
    bad "--local 2 --stats: no per-worker vulkan lines: $(grep 'stage' "$T/vk_l2.err" | head -4)"
fi

# the per-step figures of FORWARD_DONE, summed per stage by the coordinator,
# against each worker's cumulative STATS_OK (both runs: fresh workers each)
cmpvk=$(awk '
    /^  stage [0-9]+ vulkan: / { st = $2; c = $4; p = $8; gsub(/\(/, "", p); pr = $12
        d = $0; sub(/.*; device /, "", d); sub(/ ms.*/, "", d); n_so++; next }
    /^    vulkan steps: / && st != "" { c2 = $3; p2 = $7; gsub(/\(/, "", p2); pr2 = $16
        d2 = $0; sub(/.*; device /, "", d2); sub(/ ms.*/, "", d2)
        if (c2 == c && p2 == p && c2 > 0 && d2 - d <= 0.1 + d / 100 && d - d2 <= 0.1 + d / 100 &&
            pr2 + 0 <= pr + 0)
            good++
        else
            msg = msg sprintf("stage %s: STATS_OK %s calls %s pairs %s ms %s promotions, FORWARD_DONE %s calls %s pairs %s ms %s promotions; ", st, c, p, d, pr, c2, p2, d2, pr2)
        st = "" }
    END { printf "%d %d %s", good, n_so, msg }' "$T/vk_l2.err")
read -r vgood vlines vmsg <<<"$cmpvk"
if [ "$vgood" -ge 4 ] && [ "$vgood" -eq "$vlines" ]; then
    ok "--local 2 --stats: per-stage vulkan figures from FORWARD_DONE = the workers' STATS_OK totals in calls, pairs, device ms, promotions <= ($vgood of $vlines stage lines; $(grep -m1 '^    vulkan steps' "$T/vk_l2.err" | cut -c5-130)...)"
else
    bad "--local 2 --stats: FORWARD_DONE vulkan figures vs STATS_OK: $vgood of $vlines lines agree: $vmsg $(grep 'vulkan' "$T/vk_l2.err" | head -4)"
fi
if grep -q '^    vulkan steps' "$T/cpu_l2.err"; then
    bad "--local 2 without --vk prints vulkan step figures: $(grep -m1 'vulkan steps' "$T/cpu_l2.err")"
else
    ok "--local 2 without --vk: no vulkan step figures"
fi

# fallbacks
VK_ICD_FILENAMES=$T/none.json run nodev --local 0 --usage "$HIST" --vk --vk-gb "$GB_ALL"
rc=$?
if [ $rc -eq 0 ] && same cpu nodev && grep -q "tier is off, the CPU computes every expert" "$T/nodev.err"; then
    ok "no Vulkan driver: $(grep -o 'tier is off.*' "$T/nodev.err" | head -1 | cut -c1-120), same bytes"
else
    bad "no Vulkan driver: rc $rc, $(grep -i vulkan "$T/nodev.err" | head -2)"
fi
run nodev7 --local 0 --usage "$HIST" --vk --vk-device 7 --vk-gb "$GB_ALL"
if same cpu nodev7 && grep -q "no Vulkan device 7" "$T/nodev7.err"; then
    ok "--vk-device 7: '$(grep -o 'no Vulkan device 7[^)]*)' "$T/nodev7.err" | head -1)', CPU, same bytes"
else
    bad "--vk-device 7: $(grep -i vulkan "$T/nodev7.err" | head -2)"
fi
K3_TEST_VK_FAIL_UPLOAD=9 run upfail --local 0 --usage "$HIST" --vk --vk-gb "$GB_FEW"
if same cpu upfail && [ "$(stat upfail 'upload failures')" -ge 1 ] &&
    grep -q "injected by K3_TEST_VK_FAIL_UPLOAD" "$T/upfail.err"; then
    ok "an upload failing mid-run: that expert stays on the CPU, same bytes ($(stat upfail promotions) promotions)"
else
    bad "upload failure: $(vkline upfail) $(grep -i 'upload' "$T/upfail.err" | head -2)"
fi
K3_TEST_VK_FAIL_APPLY=20 run appfail --local 0 --usage "$HIST" --vk --vk-gb "$GB_ALL"
if same cpu appfail && [ "$(stat appfail 'CPU fallbacks')" -ge 1 ] &&
    grep -q "tier off for the rest of this process" "$T/appfail.err" &&
    vkline appfail | grep -q "device failed: off"; then
    ok "a device call failing mid-run: its experts and all later ones on the CPU, same bytes"
else
    bad "device call failure: $(vkline appfail) $(grep -i 'tier off' "$T/appfail.err" | head -1)"
fi

# what is not promised, said at start
"$C" --model "$TINY" --local 0 --usage off --ids "$P2" --ngen 2 --vk --vk-gb "$GB_ALL" \
    >"$T/idot.out" 2>"$T/idot.err"
rc=$?
if [ $rc -eq 0 ] && grep -q "without --exact.*tokens may differ" "$T/idot.err"; then
    ok "--vk without --exact runs and warns that tokens may differ from a CPU-only run"
else
    bad "--vk without --exact: rc $rc $(tail -2 "$T/idot.err")"
fi
K3_VK_FMA=native "$C" --model "$TINY" --local 0 --usage off --exact --ids "$P2" --ngen 2 --vk \
    --vk-gb "$GB_ALL" >"$T/fma.out" 2>"$T/fma.err"
rc=$?
if [ $rc -eq 0 ] && grep -q "lacks shaderFloat64\|own fma()" "$T/fma.err"; then
    ok "the device's own fma() (no shaderFloat64): runs and warns that tokens may differ"
else
    bad "K3_VK_FMA=native: rc $rc $(grep -i vulkan "$T/fma.err" | head -2)"
fi
# serve: three requests at once on one tier (device jobs of several sessions
# queued on its device thread, promotions racing them) give the texts a
# CPU-only server gives one by one; the tier's counters in /metrics
P0=$((27500 + RANDOM % 50))
P1=$((P0 + 50))
gen() { # port n: completion n (greedy, --exact) into $T/gen.<port>.<n>
    curl -s -m 120 "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"prompt\":\"prompt number $2: the quick brown fox\",\"max_tokens\":8,\"temperature\":0}" \
        | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])' \
        >"$T/gen.$1.$2" 2>/dev/null
}
if serve_start "$T/srv0.out" "$T/srv0.err" --model "$TINY" --local 0 --exact --usage off \
    --port "$P0" && serve_start "$T/srv1.out" "$T/srv1.err" --model "$TINY" --local 0 --exact \
    --usage "$HIST" --port "$P1" --vk --vk-gb "$GB_FEW"; then
    for n in 1 2 3; do gen "$P0" $n; done
    gp=()
    for n in 1 2 3; do
        gen "$P1" $n &
        gp+=($!)
    done
    wait "${gp[@]}"
    same3=0
    for n in 1 2 3; do
        [ -s "$T/gen.$P0.$n" ] && cmp -s "$T/gen.$P0.$n" "$T/gen.$P1.$n" && same3=$((same3 + 1))
    done
    [ $same3 -eq 3 ] && ok "serve --vk: 3 concurrent requests give the CPU server's texts" ||
        bad "serve --vk concurrent: $same3 of 3 texts equal ($(head -c 80 "$T/gen.$P0.1") / $(head -c 80 "$T/gen.$P1.1"))"
    curl -s -m 10 "http://127.0.0.1:$P1/metrics" >"$T/srv.metrics"
    calls=$(awk '$1 == "k3_vk_expert_calls_total" {print $2}' "$T/srv.metrics")
    if [ "${calls:-0}" -gt 0 ] 2>/dev/null && grep -q '^k3_vk_resident_experts ' "$T/srv.metrics" &&
        grep -q '^k3_vk_off 0' "$T/srv.metrics"; then
        ok "serve --vk: /metrics has the tier's counters ($calls device expert calls, $(awk '$1 == "k3_vk_evictions_total" {print $2}' "$T/srv.metrics") evictions)"
    else
        bad "serve --vk /metrics: $(grep k3_vk "$T/srv.metrics" | head -3)"
    fi
else
    bad "serve did not start: $(tail -3 "$T/srv0.err") $(tail -3 "$T/srv1.err")"
fi
# a cluster coordinator's /metrics: the workers' tiers per stage, summed
# from FORWARD_DONE
P2=$((27600 + RANDOM % 100))
if serve_start "$T/srv2.out" "$T/srv2.err" --model "$TINY" --local 2 --exact --usage "$HIST" \
    --port "$P2" --vk --vk-gb "$GB_FEW"; then
    gen "$P2" 1
    cmp -s "$T/gen.$P0.1" "$T/gen.$P2.1" && ok "serve --local 2 --vk: the CPU server's text" ||
        bad "serve --local 2 --vk: text $(head -c 80 "$T/gen.$P2.1") vs $(head -c 80 "$T/gen.$P0.1")"
    curl -s -m 10 "http://127.0.0.1:$P2/metrics" >"$T/srv2.metrics"
    nfam=0
    for f in k3_vk_expert_calls_total k3_vk_pairs_total k3_vk_steps_total k3_vk_resident_experts \
        k3_vk_promotions_total k3_vk_device_seconds_total k3_vk_cpu_seconds_total \
        k3_vk_wait_seconds_total; do
        grep -q "^# TYPE $f " "$T/srv2.metrics" && grep -q "^$f{stage=\"0\",layers=\"[0-9]*-[0-9]*\"} " "$T/srv2.metrics" &&
            grep -q "^$f{stage=\"1\"," "$T/srv2.metrics" && nfam=$((nfam + 1))
    done
    c0=$(awk -F'[ ]' '$1 ~ /^k3_vk_expert_calls_total\{stage="0"/ {print $2}' "$T/srv2.metrics")
    c1=$(awk -F'[ ]' '$1 ~ /^k3_vk_expert_calls_total\{stage="1"/ {print $2}' "$T/srv2.metrics")
    if [ "$nfam" -eq 8 ] && [ "${c0:-0}" -gt 0 ] 2>/dev/null && [ "${c1:-0}" -gt 0 ] 2>/dev/null &&
        ! grep -q '^k3_vk_expert_calls_total ' "$T/srv2.metrics"; then
        ok "serve --local 2 --vk /metrics: 8 vulkan families per stage ($c0 / $c1 device expert calls on stages 0 / 1)"
    else
        bad "serve --local 2 --vk /metrics: $nfam of 8 families with both stages, calls ${c0:-?} / ${c1:-?}: $(grep k3_vk "$T/srv2.metrics" | head -4)"
    fi
else
    bad "serve --local 2 --vk did not start: $(tail -3 "$T/srv2.err")"
fi
exit $fail
