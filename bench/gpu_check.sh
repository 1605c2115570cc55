#!/usr/bin/env bash
# The prepared one-GPU probe (issue 26): about 8 minutes on one bare H200, run from the repository root.
#
#   bash bench/gpu_check.sh [OUT_DIR]            # on the GPU machine; default OUT_DIR gpu_check_out
#   bash bench/gpu_check.sh --cpu-smoke [OUT]    # the same script end to end at toy sizes on a CPU
#
# A lent GPU machine is bare (torch, no torchao, no mlperf-logging) and short-lived (~15 minutes in all,
# start-up included), and reaches no network. So the wheels travel with the checkout: before the run, on a
# machine with the network,
#
#   pip download --no-deps -d bench/wheels torchao==0.18.0 mlperf-logging pyyaml tqdm   # ~4.5 MB;
#                                                                                        # git-ignored
# (pyyaml is built per Python version: add --only-binary=:all: --python-version 3.X --platform
# manylinux2014_x86_64 when the device's Python differs from this machine's)
# and hand the folder to the device tool as an ignored path it carries (`carry: ["bench/wheels"]`; it
# carries up to 64 MiB). Add any other wheel `ttt synth` needs there and lacks (the script lists the missing
# imports first). Here every wheel in bench/wheels is installed with --no-index --no-deps.
#
# What it measures, one JSON line per figure appended to OUT_DIR/records.jsonl as each is measured (see
# bench/gpu_probe.py): llama31_8b at reference width, 4 layers, compiled bf16, float8 tensorwise and rowwise,
# eager; the fused head+loss before/after at the 8B shape; SDPA backends at the 8B and gpt_oss_20b attention
# shapes; gpt_oss_20b's sliding window, mask path vs torch's native windowed kernel; the MoE experts' cast
# once per step vs per micro-batch; MXFP8 (on sm90: its one-line refusal); compile coverage per model
# family (graph breaks, eager vs compiled step at the tiny configs); a 2/4/8-layer depth sweep
# extrapolated to 32 layers; gpt_oss_20b at 2 layers. MFU in both FLOP
# conventions (causal half: ours; full square: torchtitan / NeMo <= 25.07). A run cut short keeps its records;
# a figure that fails is a record too. Then a table of them.
#
# GPU_CHECK_BUDGET_S (default 480) bounds the probe; GPU_CHECK_SUITE=1 also runs `ttt suite --tier tiny` on
# the GPU afterwards (the previous content of this script; ~10+ minutes more, sources from ../shared/data).
set -u
smoke=()
if [ "${1:-}" = "--cpu-smoke" ]; then smoke=(--cpu-smoke); shift; fi
out=${1:-gpu_check_out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"
for whl in bench/wheels/*.whl; do  # one at a time: a wheel for another Python must not block the rest
    [ -e "$whl" ] || continue
    "$py" -m pip install --no-index --no-deps --quiet "$whl" 2>&1 | tail -1
done
"$py" - <<'EOF'
import importlib.util
need = ["torch", "numpy", "yaml", "tqdm", "mlperf_logging", "torchao"]  # what `ttt synth` and the probe import
missing = [m for m in need if importlib.util.find_spec(m) is None]
print("missing imports:", ", ".join(missing) if missing else "none")
EOF

"$py" bench/gpu_probe.py "${smoke[@]}" --out "$out" --budget-s "${GPU_CHECK_BUDGET_S:-480}" > "$out/probe.txt" 2>&1
echo "probe exit $? (log $out/probe.txt)"

echo
echo "== gpu_check records ($out/records.jsonl)"
"$py" - "$out/records.jsonl" <<'EOF' | tee "$out/table.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    name, st = f"{r['kind']}:{r['name']}", r.get("status", "")
    if st in ("failed", "skipped"):
        print(f"{name:<52} {st}: {r.get('error') or r.get('reason')}")
    elif r["kind"] in ("synth", "extrapolated"):
        print(f"{name:<52} {r['tokens_per_s']:>10,.0f} tok/s  MFU causal {r['mfu_causal']:6.1%}  "
              f"full-square {r['mfu_full_square']:6.1%}" + (f"  mem {r['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in r else ""))
    elif r["kind"] == "head_loss":
        print(f"{name:<52} fp32-buffer {r['fp32_buffer_s']*1e3:8.1f} ms  bf16-logits {r['bf16_logits_s']*1e3:8.1f} ms  "
              f"x{r['speedup']:.2f}  max rel diff {r['max_rel_diff']}")
    elif r["kind"] == "attention":
        print(f"{name:<52} {r['fwd_bwd_ms']:8.2f} ms fwd+bwd  {r['tflops_causal']:7.1f} TFLOP/s (causal)")
    elif r["kind"] == "window":
        native = (f"native {r['native_fwd_bwd_ms']:8.2f} ms  x{r['speedup']:.2f}  max |diff| {r['max_abs_diff']}"
                  if "native_fwd_bwd_ms" in r else r.get("native", ""))
        print(f"{name:<52} mask {r['mask_fwd_bwd_ms']:8.2f} ms  {native}  check {r['native_window_works']}")
    elif r["kind"] == "compile_coverage":
        print(f"{name:<52} graphs {r['graphs']} breaks {r['breaks']}  eager {r['eager_step_s']*1e3:8.1f} ms  "
              f"compiled ({r['backend']}) {r['compiled_step_s']*1e3:8.1f} ms  x{r['speedup']:.2f}  "
              f"eager outside: {', '.join(r['eager_outside'])}")
    elif r["kind"] == "moe_cast":
        print(f"{name:<52} per-micro-batch cast {r['per_micro_batch_cast_s']*1e3:8.1f} ms  per-step "
              f"{r['per_step_cast_s']*1e3:8.1f} ms  x{r['speedup']:.2f}  grad diff {r['max_abs_grad_diff']}")
    else:
        print(f"{name:<52} {json.dumps({k: v for k, v in r.items() if k not in ('kind', 'name')})}")
EOF

if [ "${GPU_CHECK_SUITE:-0}" = 1 ] && [ ${#smoke[@]} -eq 0 ]; then
    "$py" -m timetotrain suite --tier tiny --runs 1 --seed 1234 --device cuda --data ../shared/data \
        --out "$out/suite_tiny" > "$out/suite_tiny.txt" 2>&1
    echo "ttt suite --tier tiny: exit $? (log $out/suite_tiny.txt)"
    sed -n '/^benchmark /,$p' "$out/suite_tiny.txt" | tee -a "$out/table.txt"
fi
