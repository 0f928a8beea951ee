"""Compile time of the GRPO step at Qwen3.5-9B width vs depth (AOT on CPU, abstract params).

The step the GRPO trainer runs (`bat_jax.train.Trainer` with the GRPO loss, full remat, bf16
weight casts over fp32 master weights, AdamW) is lowered and compiled for 8 fake CPU devices
(mesh fsdp=8, the bat9b layout) at real 9B widths (vocab 248,320, hidden 4,096, DeltaNet x3 +
attention cycles), with abstract params and optimizer state: nothing is allocated. With
`scan_layers` the layer cycle is one `lax.scan` body, so compile time should not grow with
depth; `--unscanned` adds the unrolled model for comparison. Ratio printed last.

  PYTHONPATH=. python experiments/perf/compile_time.py                  # 8 vs 32 layers, scanned
  PYTHONPATH=. python experiments/perf/compile_time.py --unscanned      # + unrolled at 8 layers
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bat_jax import sharding  # noqa: E402
from bat_jax.grpo import GrpoConfig, grpo_loss_fn  # noqa: E402
from bat_jax.model import ModelConfig, build_model  # noqa: E402
from bat_jax.train import OptimizerConfig, StepConfig, Trainer, TrainerConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from grpo_step import qwen3_5_width  # noqa: E402  (shared perf helpers)


def qwen3_5_9b(layers: int) -> dict:
  """Qwen3.5-9B text widths (HF config.json fields) with `layers` layers."""
  return qwen3_5_width(layers=layers, hidden=4096, intermediate=12288, heads=16, kv_heads=4,
                       linear_v_heads=32, tie=False)


def compile_seconds(layers: int, scan: bool, args) -> tuple[float, float, float, float]:
  """(lower s, compile s, CPU s of both, temp GiB per device) of one abstract GRPO step.
  CPU seconds (all threads of the process) are the figure that a loaded box disturbs least."""
  cfg = ModelConfig.from_hf_dict(qwen3_5_9b(layers), dtype="bfloat16", param_dtype="float32")
  cfg = cfg.replace(scan_layers=scan, attention_impl="chunked")
  abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
  mesh = sharding.make_mesh(data=1, fsdp=jax.device_count(), tensor=1)
  step = StepConfig(num_micro_batches=args.micro, remat_policy="full", weight_dtype="bfloat16")
  trainer = Trainer.for_model(abstract, grpo_loss_fn(GrpoConfig(kl_coef=0.0)),
                              TrainerConfig(OptimizerConfig(learning_rate=1e-6), step), mesh,
                              sharding.DEFAULT_RULES)
  b, t = args.batch, args.seq
  batch = {"input_ids": jax.ShapeDtypeStruct((b, t), jnp.int32),
           "valid": jax.ShapeDtypeStruct((b, t), jnp.int32),
           "loss_mask": jax.ShapeDtypeStruct((b, t), jnp.float32),
           "old_logp": jax.ShapeDtypeStruct((b, t), jnp.float32),
           "advantages": jax.ShapeDtypeStruct((b,), jnp.float32)}
  start, cpu_start = time.perf_counter(), time.process_time()
  lowered = trainer.lower_step(batch)
  lowered_at = time.perf_counter()
  analysis = lowered.compile().memory_analysis()
  done = time.perf_counter()
  cpu = time.process_time() - cpu_start
  return lowered_at - start, done - lowered_at, cpu, analysis.temp_size_in_bytes / 2**30


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", default="8,32", help="comma-separated depths (multiples of 4)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--micro", type=int, default=1)
  parser.add_argument("--unscanned", action="store_true", help="also time the unrolled model")
  args = parser.parse_args()
  depths = [int(x) for x in args.layers.split(",")]
  print(f"devices={jax.device_count()} ({jax.devices()[0].platform}) batch={args.batch} "
        f"seq={args.seq} micro={args.micro}; 9B widths, bf16 compute / fp32 params, remat full")
  totals, cpus = {}, {}
  runs = [(d, True) for d in depths] + ([(depths[0], False)] if args.unscanned else [])
  for layers, scan in runs:
    lower_s, compile_s, cpus[layers, scan], temp = compile_seconds(layers, scan, args)
    totals[layers, scan] = lower_s + compile_s
    print(f"layers={layers:3d} {'scanned ' if scan else 'unrolled'}: lower {lower_s:6.1f} s  "
          f"compile {compile_s:6.1f} s  total {lower_s + compile_s:6.1f} s  "
          f"(CPU {cpus[layers, scan]:6.1f} s)  temp/device {temp:6.2f} GiB", flush=True)
  if args.unscanned:
    print(f"unrolled/scanned at {depths[0]} layers: "
          f"{totals[depths[0], False] / totals[depths[0], True]:.2f}")
  print(f"compile time ratio {depths[-1]}/{depths[0]} layers (scanned): "
        f"{totals[depths[-1], True] / totals[depths[0], True]:.2f} wall, "
        f"{cpus[depths[-1], True] / cpus[depths[0], True]:.2f} CPU")


if __name__ == "__main__":
  main()
