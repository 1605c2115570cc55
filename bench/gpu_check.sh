#!/usr/bin/env bash
# GPU readiness: one prepared script to run unchanged on a machine with one CUDA GPU. No effect on the CPU
# test suite. Run it from the repository root:
#
#   bash bench/gpu_check.sh [SOURCES_DIR] [OUT_DIR]
#
# SOURCES_DIR: raw sources laid out as ../shared/data (c4/en, govreport/, tokenizers/), from which
# `ttt suite` prepares each tiny tier's data (cached under $TTT_CACHE/data); default ../shared/data.
# OUT_DIR: where logs, summaries and the table go; default gpu_check_out.
#
# It runs, each bf16 on one GPU:
#   1. `ttt synth llama31_8b --tier reference` at the reference width with 4 of its 32 layers, eager and
#      compiled (tokens/s, model TFLOP/s, MFU against the datasheet peak, memory);
#   2. `ttt synth gpt_oss_20b --tier reference` with 2 of its 24 layers (the MoE grouped-GEMM path, the
#      blocked sliding-window band), eager and compiled;
#   2b. `ttt synth llama2_70b_lora --tier reference` with 4 of its 80 layers (frozen base, LoRA adapters);
#   3. `ttt suite --tier tiny --runs 1 --device cuda`: every benchmark that has a tiny tier, to its target
#      on the GPU (fp32, as their RCPs were made), each log through the official compliance engine;
# then prints one table. A step that fails is reported in the table and the script goes on.
set -u
src=${1:-../shared/data}
out=${2:-gpu_check_out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
ttt() { "$py" -m timetotrain "$@"; }

echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

rows=()
synth() {  # name, then ttt synth arguments
    local name=$1; shift
    local dir="$out/synth_$name"
    if ttt synth "$@" --device cuda --precision bf16 --logdir "$dir" > "$out/synth_$name.txt" 2>&1; then
        rows+=("$("$py" - "$dir" "$name" <<'EOF'
import glob, json, sys
s = json.load(open(glob.glob(sys.argv[1] + "/synth/*/*/summary.json")[0]))
item = s["item"]
print(f"{sys.argv[2]:<26}{s[item + '_per_s']:>14,.0f} {item}/s  {s['model_tflops_per_s']:>8,.1f} TFLOP/s  "
      f"MFU {s['mfu']:>6.1%}  step p50 {s['step_time_s']['p50']:.3f} s  mem {s['peak_memory_bytes'] / 2**30:.1f} GiB")
EOF
)")
    else
        rows+=("$(printf '%-26s FAILED (see %s)' "$name" "$out/synth_$name.txt")")
        tail -5 "$out/synth_$name.txt"
    fi
}

synth llama8b_4L_eager llama31_8b --tier reference --layers 4 --steps 8 --warmup-steps 3 --set global_batch_size=8
synth llama8b_4L_compiled llama31_8b --tier reference --layers 4 --steps 8 --warmup-steps 3 --set global_batch_size=8 --compile
synth gptoss20b_2L_eager gpt_oss_20b --tier reference --layers 2 --steps 8 --warmup-steps 3 --set global_batch_size=8
synth gptoss20b_2L_compiled gpt_oss_20b --tier reference --layers 2 --steps 8 --warmup-steps 3 --set global_batch_size=8 --compile
synth llama2_70b_lora_4L llama2_70b_lora --tier reference --layers 4 --steps 8 --warmup-steps 3

# Every benchmark with a tiny tier, as the registry lists them (benchmarks added later join by themselves):
# `ttt suite` prepares their data from the raw sources (cached), makes the bases a tier needs, runs each to
# its target on the GPU, checks every log with the official engine and prints its scorecard.
suite_out="$out/suite_tiny"
start=$(date +%s)
if ttt suite --tier tiny --runs 1 --seed 1234 --device cuda --data "$src" --out "$suite_out" > "$out/suite_tiny.txt" 2>&1; then
    status=ok
else
    status="not all converged/compliant (exit $?)"
fi
secs=$(( $(date +%s) - start ))
rows+=("$(printf '%-26s %-20s %5s s  (scorecard below; log %s)' "ttt suite --tier tiny" "$status" "$secs" "$out/suite_tiny.txt")")

echo
echo "== gpu_check results"
printf '%s\n' "${rows[@]}" | tee "$out/table.txt"
echo
sed -n '/^benchmark /,$p' "$out/suite_tiny.txt" | tee -a "$out/table.txt"
