#!/usr/bin/env bash
# One-shot GPU check (issue 11, deliver 6). Run from anywhere:
#
#   bash experiments/gpu/check.sh               # an H200 (or any CUDA GPU), < 10 min
#   bash experiments/gpu/check.sh --cpu-smoke   # tiny sizes on CPU: checks the script itself
#
# Uses whatever JAX / PyTorch / transformers are installed; installs nothing (the GPU machine has
# no package registry). Steps, each under its own timeout so one failure does not stop the rest:
#   1. versions and devices
#   2. bf16 (and fp32) logit parity at a 9B-pattern config vs transformers, padding check
#   3. DeltaNet stress cases vs a float64 recurrence (+ a fwd+bwd kernel timing)
#   4. GRPO step tokens/s and MFU at ~1.9B (experiments/perf/grpo_step.py --mode mfu)
#   5. compiled memory on the GPU beside the CPU memory plan (bat_jax.memory_plan), same config
# The summary goes to stdout and, when $OUT is set, to $OUT/gpu_check_summary.txt (with each
# step's full log and JSON under $OUT/gpu_check/).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
PY=${PYTHON:-python}

SMOKE=0
[[ "${1:-}" == "--cpu-smoke" ]] && SMOKE=1
# Step timeouts are sized for the GPU run; a CPU smoke run on a busy box may scale them up.
TIME_SCALE=${TIME_SCALE:-$(( SMOKE ? 4 : 1 ))}
if [[ -n "${OUT:-}" ]]; then WORK="$OUT/gpu_check"; else WORK="$(mktemp -d)/gpu_check"; fi
mkdir -p "$WORK"
SUMMARY="$WORK/summary.txt"
: > "$SUMMARY"
START=$(date +%s)

note() { echo "$*" | tee -a "$SUMMARY"; }

# run NAME TIMEOUT_S CMD...: logs to $WORK/NAME.log, records rc, wall time and the last line.
run() {
  local name=$1 limit=$(( $2 * TIME_SCALE )); shift 2
  local t0=$(date +%s)
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$? t1=$(date +%s)
  tail -n 25 "$WORK/$name.log"
  local last; last=$(grep -v '^\s*$' "$WORK/$name.log" | tail -n 1)
  [[ $rc == 124 ]] && last="TIMED OUT after ${limit}s; $last"
  note "[$name] rc=$rc $((t1 - t0))s :: $last"
}

if [[ $SMOKE == 1 ]]; then
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
  PARITY_ARGS=(--cpu-smoke)
  STRESS_ARGS=(--cases=cos0.9_beta0.86_g-0.01,long_padding,len65 --time=1,128,2)
  MFU_ARGS=(--mode mfu --preset tiny --batch 2 --seq 64 --iters 1 --chunk 32)
  PLAN_CONFIG=(--config=configs/tiny.py)
else
  PARITY_ARGS=(--vocab=32768 --intermediate=12288 --tokens=200 --pad=1000)
  STRESS_ARGS=(--time=8,4096,32)
  MFU_ARGS=(--mode mfu --preset 1.9b --batch 8 --seq 4096 --iters 3 --chunk 512)
  # bat9b at 4 of its 32 layers on one device (a mesh this machine has), both backends.
  PLAN_CONFIG=(--config=configs/bat9b.py --config.mesh.data=1 --config.mesh.fsdp=1
               --config.mesh.tensor=1 --num_layers=4)
fi

note "gpu check $(date -u +%FT%TZ) mode=$([[ $SMOKE == 1 ]] && echo cpu-smoke || echo gpu) host=$(hostname)"
run versions 120 "$PY" -c '
import jax, torch, transformers, flax
print("jax", jax.__version__, "flax", flax.__version__, "torch", torch.__version__,
      "transformers", transformers.__version__, "backend", jax.default_backend(),
      "devices", [d.device_kind for d in jax.devices()], "torch.cuda", torch.cuda.is_available())'
run parity 300 "$PY" experiments/gpu/parity_9b.py "${PARITY_ARGS[@]}" --json="$WORK/parity.json"
run deltanet_stress 150 "$PY" experiments/gpu/deltanet_stress.py "${STRESS_ARGS[@]}" \
    --json="$WORK/deltanet_stress.json"
run grpo_mfu 240 "$PY" experiments/perf/grpo_step.py "${MFU_ARGS[@]}"
if "$PY" -c 'import bat_jax.memory_plan' > /dev/null 2>&1; then
  run plan_cpu 300 "$PY" -m bat_jax.memory_plan "${PLAN_CONFIG[@]}" --json="$WORK/plan_cpu.json"
  run plan_gpu 300 "$PY" experiments/gpu/plan_memory.py "${PLAN_CONFIG[@]}" \
      --json="$WORK/plan_gpu.json"
  run plan_compare 60 "$PY" experiments/gpu/compare_plans.py "$WORK/plan_cpu.json" \
      "$WORK/plan_gpu.json"
else
  note "[memory] not available: bat_jax.memory_plan is missing in this checkout"
fi

note "total $(( $(date +%s) - START ))s; logs in $WORK"
echo
echo "===== SUMMARY ====="
cat "$SUMMARY"
if [[ -n "${OUT:-}" ]]; then cp "$SUMMARY" "$OUT/gpu_check_summary.txt"; fi
