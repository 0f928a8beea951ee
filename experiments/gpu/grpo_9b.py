r"""Runs a real GRPO step of a config on this machine's devices and measures it: peak device
memory (`memory_stats()["peak_bytes_in_use"]`), step time and MFU, beside the memory plan's
figure for the same shapes.

The programs are the run's own (`bat_jax.run_programs`: the config's mesh, sharding rules,
GRPO loss, micro-batches, remat, weight and reference dtypes; `Trainer` places and compiles):
the old-policy and reference logprob passes, then the donated step, on random params (nothing
is loaded) and a random batch of `grpo.prompt_groups * grpo.group_size` rows of
`rollout.limits.max_context_tokens` tokens. Takes `bat_jax.memory_plan`'s flags (`--config`,
overrides, `--num_layers`) so the plan (`--plan_json`, from `python -m bat_jax.memory_plan` with
the same flags) and the run have the same shapes; the run uses the config's attention kernel,
the plan the chunked one it can compile on CPU.

  PYTHONPATH=. python experiments/gpu/grpo_9b.py --config=configs/bat9b.py \
      --config.mesh.fsdp=1 --num_layers=4 --plan_json=plan.json --json=run.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from absl import app, flags

from bat_jax import memory_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
from grpo_step import model_flops_per_token  # noqa: E402  (one MFU formula for both scripts)

_ITERS = flags.DEFINE_integer("iters", 2, "timed steps after the compiling one")
_PLAN = flags.DEFINE_string("plan_json", None, "memory_plan --json output for the same flags")
_PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", None,
                                  "device bf16 dense peak (default: known GPUs, else no MFU)")
# bf16 dense peak TFLOP/s by device kind (SXM parts).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0}
GIB = 2**30


def peak_tflops(kind: str) -> float | None:
  if _PEAK_TFLOPS.value:
    return _PEAK_TFLOPS.value
  return next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)


def random_batch(rows: int, length: int, vocab: int, kl: bool):
  """A GRPO step batch: the first quarter prompt, then response; the last 1/8 of each odd row
  is padding (so `valid` masks a real tail)."""
  import numpy as np
  rng = np.random.default_rng(0)
  ids = rng.integers(0, vocab, (rows, length), dtype=np.int32)
  valid = np.ones((rows, length), np.int32)
  valid[1::2, length - length // 8:] = 0
  loss_mask = valid.astype(np.float32)
  loss_mask[:, :length // 4] = 0.0
  batch = {"input_ids": ids, "valid": valid, "loss_mask": loss_mask,
           "advantages": rng.normal(size=rows).astype(np.float32)}
  return batch


def run(cfg, num_layers: int | None, iters: int) -> dict:
  import jax
  from flax import nnx
  from bat_jax import run_programs
  from bat_jax.model import build_model

  model_cfg = memory_plan.model_config(cfg, num_layers, attention_impl=cfg.model.attention_impl)
  mesh = run_programs.run_mesh(cfg)
  model = build_model(model_cfg, rngs=nnx.Rngs(0))
  trainer = run_programs.grpo_trainer(cfg, model, mesh)
  state = trainer.init_state(nnx.state(model, nnx.Param))
  del model
  loss_cfg, pass_cfg = run_programs.grpo_config(cfg), run_programs.logprob_pass_config(cfg)
  kl = loss_cfg.kl_coef > 0
  ref = trainer.reference_params(state.params, cfg.trainer.reference_dtype) if kl else None
  rows, length = cfg.grpo.prompt_groups * cfg.grpo.group_size, memory_plan.trajectory_len(cfg)
  batch = trainer.place_batch(random_batch(rows, length, model_cfg.vocab_size, kl))

  def one_step(state):
    full = dict(batch)
    full["old_logp"] = trainer.logprobs(state.params, full, pass_cfg, "old_logp")
    if kl:
      full["ref_logp"] = trainer.logprobs(ref, full, pass_cfg, "ref_logp")
    state, metrics = trainer.step(state, full)
    return state, jax.block_until_ready(metrics)

  start = time.monotonic()
  state, metrics = one_step(state)                  # compiles the three programs
  first = time.monotonic() - start
  times = []
  for _ in range(iters):
    start = time.monotonic()
    state, metrics = one_step(state)
    times.append(time.monotonic() - start)
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  seconds = min(times) if times else first
  flops = model_flops_per_token(model_cfg, n_params, length) * rows * length / len(jax.devices())
  peak = peak_tflops(device.device_kind)
  return {"backend": f"{jax.default_backend()} ({device.device_kind})", "devices": len(jax.devices()),
          "layers": model_cfg.num_hidden_layers, "hidden": model_cfg.hidden_size,
          "params": n_params, "batch": [rows, length],
          "loss": float(metrics["loss"]) if "loss" in metrics else None,
          "first_step_s": round(first, 2), "step_s": round(seconds, 3),
          "tokens_per_s": round(rows * length / seconds, 1),
          "tflops_per_device": round(flops / seconds / 1e12, 2),
          "mfu": None if peak is None else round(flops / seconds / (peak * 1e12), 3),
          "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
          "programs": {k: v for k, v in trainer.memory.items()}}


def compare(result: dict, plan: dict | None) -> list[str]:
  """Lines: measured peak vs the plan's JAX peak for the same shapes (per device)."""
  measured = result["peak_bytes_in_use"]
  planned = None if plan is None else plan["per_device"]["peak"]
  lines = ["measured peak per device: "
           + ("n/a (this backend reports no memory_stats)" if measured is None
              else f"{measured / GIB:.2f} GiB"),
           "plan peak per device: " + ("n/a (no plan)" if planned is None
                                       else f"{planned / GIB:.2f} GiB")]
  if measured is not None and planned:
    lines.append(f"measured / plan: {measured / planned:.2f}")
  return lines


def main(argv, held: memory_plan.PlanFlags) -> int:
  del argv
  cfg = held.config.value
  result = run(cfg, held.num_layers.value, _ITERS.value)
  plan = json.loads(Path(_PLAN.value).read_text()) if _PLAN.value else None
  result["plan_peak"] = None if plan is None else plan["per_device"]["peak"]
  print(f"GRPO step on {result['backend']} x{result['devices']}: {result['layers']} layers, "
        f"hidden {result['hidden']}, {result['params'] / 1e9:.2f}B params, batch "
        f"{result['batch']}, loss {result['loss']}")
  print(f"first step (compiles) {result['first_step_s']} s, step {result['step_s']} s, "
        f"{result['tokens_per_s']} tokens/s, {result['tflops_per_device']} TFLOP/s per device, "
        f"MFU {result['mfu'] if result['mfu'] is not None else 'n/a (unknown device peak)'}")
  for line in compare(result, plan):
    print(line)
  if held.json.value:
    Path(held.json.value).write_text(json.dumps(result, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  _HELD = memory_plan.define_flags()
  app.run(lambda argv: sys.exit(main(argv, _HELD)))
