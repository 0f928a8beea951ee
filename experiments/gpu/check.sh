#!/usr/bin/env bash
# One-shot GPU check (issue 25, deliver 6): answers on the first GPU it meets, in <= 8 minutes.
#
#   bash tools/gpu_wheelhouse.sh          # here, with a package registry: .whl/gpu (~4 MiB)
#   bash experiments/gpu/check.sh         # there: an H200 (any CUDA GPU); no GPU: CPU smoke
#   # through the device tool: run("bash experiments/gpu/check.sh", carry=[".whl/gpu"])
#
# The lent GPU box has jax[cuda], torch and transformers and no package registry. Whatever else
# the check imports (flax, optax, absl, ml_collections, pytest, ...) is installed offline from
# the wheelhouse (`pip install --no-index --find-links`) into a folder of its own, only for the
# modules that are missing; a module neither there nor in the wheelhouse is reported as
# "missing module: X" by the step that needs it. Without a GPU every step runs at reduced shapes
# on CPU (8 fake devices). Steps, each under its own timeout (sum <= 480 s):
#   setup     offline install of the missing modules                           30 s
#   versions  versions and devices                                             40 s
#   parity    bf16 / fp32 logits at 9B widths vs transformers, padding         90 s
#   deltanet  DeltaNet stress cases vs a float64 recurrence, kernel timing     60 s
#   plan      python -m bat_jax.memory_plan for the GRPO shapes below (CPU)   120 s
#   grpo_9b   a real reduced-depth 9B-width GRPO step (the 9B path's
#             run_programs: mesh, rules, passes, donated step) executed on the
#             device: measured peak (memory_stats) vs the plan, MFU           135 s
# Summary: one table on stdout and, when $OUT is set, $OUT/gpu_check_summary.txt (each step's
# log and JSON under $OUT/gpu_check/).
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:-$ROOT/.whl/gpu}
if [[ -n "${OUT:-}" ]]; then WORK="$OUT/gpu_check"; else WORK="$(mktemp -d)/gpu_check"; fi
mkdir -p "$WORK"
SITE="$WORK/site"                      # the offline-installed wheels (never the box's env)
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
# Limits are sized for the GPU box; TIME_SCALE=N stretches them on a loaded CPU box (the
# summary states it: the 8-minute budget is the GPU box's).
TIME_SCALE=${TIME_SCALE:-1}
SUMMARY="$WORK/summary.txt"
: > "$SUMMARY"
START=$(date +%s)
ROWS=()

# run NAME LIMIT_S CMD...: logs to $WORK/NAME.log; one summary row: status, seconds, result.
run() {
  local name=$1 limit=$(( $2 * TIME_SCALE )); shift 2
  local t0; t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$? t1; t1=$(date +%s)
  tail -n 15 "$WORK/$name.log"
  local result status=ok
  result=$(grep -ho "missing module: [A-Za-z0-9_.]*" "$WORK/$name.log" | head -n 1)
  if [[ -z "$result" ]]; then
    result=$(grep -o "No module named '[^']*'" "$WORK/$name.log" | head -n 1 \
             | sed "s/No module named '\([^'.]*\).*'/missing module: \1/")
  fi
  [[ -z "$result" ]] && result=$(grep -v '^\s*$' "$WORK/$name.log" | grep -v '^[IWE][0-9]\{4\} ' \
                                 | tail -n 1 | cut -c1-150)
  if [[ $rc == 124 || $rc == 137 ]]; then status="TIMEOUT"; result="after ${limit}s; $result"
  elif [[ $rc != 0 ]]; then status="FAIL rc=$rc"; fi
  ROWS+=("$(printf '%-9s %-12s %4ss  %s' "$name" "$status" "$((t1 - t0))" "$result")")
}

if "$PY" -c 'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else 1)' 2>/dev/null; then
  MODE=gpu
  PARITY_ARGS=(--vocab=32768 --intermediate=12288 --tokens=200 --pad=1000)
  STRESS_ARGS=(--time=8,4096,32)
  NDEV=$("$PY" -c 'import jax; print(jax.device_count())')
  # bat9b at 9B width, 4 of its 32 layers, over this box's GPUs (FSDP as on the 8-GPU node);
  # 1 row per device and micro-batch as there, 16,384 tokens (2 sequence tiles of 8,192).
  MODEL_ARGS=(--config=configs/bat9b.py --num_layers=4)
  SHAPE_ARGS=(--config.mesh.data=1 "--config.mesh.fsdp=$NDEV" --config.mesh.tensor=1
              --config.grpo.prompt_groups=1 "--config.grpo.group_size=$((2 * NDEV))"
              --config.grpo.micro_batches=2 --config.rollout.limits.max_context_tokens=16384)
else
  MODE=cpu
  # Short CPU compiles (as the test suite: no LLVM optimisation, the legacy fusion codegen, 2
  # causal query blocks).
  export JAX_PLATFORMS=cpu BAT_JAX_CAUSAL_QUERY_BLOCKS=2 \
      XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
  PARITY_ARGS=(--cpu-smoke)
  STRESS_ARGS=(--cases=cos0.9_beta0.86_g-0.01,long_padding,len65 --time=1,128,2)
  # The 9B layer pattern and head ratios at width 128 (config.json written below), FSDP 8.
  SMOKE_MODEL="$WORK/qwen3_5_9b_pattern"
  MODEL_ARGS=(--config=configs/bat9b.py --num_layers=4 "--config.model.path=$SMOKE_MODEL")
  SHAPE_ARGS=(--config.mesh.data=1 --config.mesh.fsdp=8 --config.mesh.tensor=1
              --config.grpo.prompt_groups=2 --config.grpo.group_size=4
              --config.grpo.micro_batches=1 --config.rollout.limits.max_context_tokens=256)
fi
note_head="gpu check $(date -u +%FT%TZ) mode=$MODE host=$(hostname) time_scale=$TIME_SCALE"
echo "$note_head"

run setup 30 "$PY" experiments/gpu/install_wheels.py "$WHEELHOUSE" "$SITE"
run versions 40 "$PY" -c '
import jax
try:
  import flax, optax
except ModuleNotFoundError as e:
  raise SystemExit(f"missing module: {e.name}")
import torch, transformers
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      "torch", torch.__version__, "transformers", transformers.__version__,
      "backend", jax.default_backend(), "devices", [d.device_kind for d in jax.devices()])'
run parity 90 "$PY" experiments/gpu/parity_9b.py "${PARITY_ARGS[@]}" --json="$WORK/parity.json"
run deltanet 60 "$PY" experiments/gpu/deltanet_stress.py "${STRESS_ARGS[@]}" \
    --json="$WORK/deltanet_stress.json"
if [[ $MODE == cpu ]]; then
  "$PY" - "$SMOKE_MODEL" <<'PY' || true
import json, pathlib, sys
from bat_jax.memory_plan import PUBLISHED_TEXT_CONFIGS
c = dict(PUBLISHED_TEXT_CONFIGS["Qwen3.5-9B"], vocab_size=1024, hidden_size=128,
         intermediate_size=384, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
         linear_value_head_dim=32)
path = pathlib.Path(sys.argv[1]); path.mkdir(parents=True, exist_ok=True)
(path / "config.json").write_text(json.dumps(c))
PY
fi
# The plan always compiles on (fake) CPU devices: JAX_PLATFORMS=cpu even on the GPU box.
run plan 120 env JAX_PLATFORMS=cpu "$PY" -m bat_jax.memory_plan "${MODEL_ARGS[@]}" \
    "${SHAPE_ARGS[@]}" --json="$WORK/plan.json"
PLAN_ARG=()
[[ -s "$WORK/plan.json" ]] && PLAN_ARG=(--plan_json="$WORK/plan.json")
run grpo_9b 135 "$PY" experiments/gpu/grpo_9b.py "${MODEL_ARGS[@]}" "${SHAPE_ARGS[@]}" \
    "${PLAN_ARG[@]}" --json="$WORK/grpo_9b.json"
# The plan-vs-measured line (grpo_9b's own log) joins the table.
CMP=$(grep -h "measured / plan\|measured peak per device" "$WORK/grpo_9b.log" | paste -sd ';' -)
MFU=$(grep -h "^first step" "$WORK/grpo_9b.log" | sed 's/.*step \([0-9.]* s\),.*MFU/step \1, MFU/')

{
  echo "$note_head"
  printf '%-9s %-12s %5s  %s\n' step status time result
  for row in "${ROWS[@]}"; do echo "$row"; done
  echo "memory:   ${CMP:-n/a}"
  echo "speed:    ${MFU:-n/a}"
  echo "total $(( $(date +%s) - START ))s; logs in $WORK"
} > "$SUMMARY"
echo
echo "===== SUMMARY ====="
cat "$SUMMARY"
if [[ -n "${OUT:-}" ]]; then cp "$SUMMARY" "$OUT/gpu_check_summary.txt"; fi
