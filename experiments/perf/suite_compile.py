"""What the test suite's XLA flags cost: compile and step time of the tiny SFT step under two
`XLA_FLAGS` sets, each in fresh child processes, alternating.

The suite is compile-bound (tests/model, train and grpo: 172 s from an empty XLA cache, 70 s
with every program already cached), so its flags trade step speed for compile speed:

  reference   --xla_backend_optimization_level=0                     (the suite until 2026-12-07)
  suite       ... --xla_cpu_use_fusion_emitters=false                 (tests/conftest.py now)
  default     no flags                                                (what launch.py runs)

Per side: `lower` (trace + lower to HLO), `compile` (XLA's backend compile), `step` (median ms of
the compiled step). Both sides build the same model and rows, so their first-step losses agree
to float tolerance. Printed last: compile reference / suite (> 1: the suite's flags compile
faster) and step suite / reference.

  PYTHONPATH=. python experiments/perf/suite_compile.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # sft_step

DEVICES = "--xla_force_host_platform_device_count=8"
SIDES = {
    "reference": f"{DEVICES} --xla_backend_optimization_level=0",
    "suite": f"{DEVICES} --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
    "default": DEVICES,
}


def child(batch: int, seq: int, targets: int, iters: int) -> dict:
  """Runs in the child: builds, lowers, compiles and times the tiny SFT step (sft_step.py's)."""
  import tempfile

  import sft_step
  from configs import tiny
  cfg = tiny.get_config()
  hf = cfg.model.hf_config.to_dict()
  hf["vocab_size"] = int(cfg.tokenizer.train.vocab_size)
  rows = sft_step.sft_rows(batch, seq, targets, hf["vocab_size"])
  with tempfile.TemporaryDirectory() as tmp:
    _, step, seconds = sft_step.jax_side(hf, rows, targets, True, tmp, with_compiled=True)
    first_loss = step()
    times = []
    for _ in range(iters):
      t = time.perf_counter()
      step()
      times.append(time.perf_counter() - t)
  return {**seconds, "step_ms": statistics.median(times) * 1e3, "first_loss": first_loss}


def run_side(flags: str, args) -> dict:
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)    # every compile from scratch
  out = subprocess.run([sys.executable, __file__, "--child", "--batch", str(args.batch),
                        "--seq", str(args.seq), "--targets", str(args.targets),
                        "--iters", str(args.iters)], env=env, capture_output=True, text=True,
                       check=False)
  if out.returncode:
    raise RuntimeError(f"child with XLA_FLAGS={flags!r} failed:\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--targets", type=int, default=64)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.batch, args.seq, args.targets, args.iters)))
    return
  results: dict[str, list[dict]] = {name: [] for name in SIDES}
  for _ in range(args.rounds):
    for name, flags in SIDES.items():
      results[name].append(run_side(flags, args))
  print(f"tiny SFT step [{args.batch}, {args.seq}], medians of {args.rounds} fresh processes each")
  med = {name: {k: statistics.median(r[k] for r in rs) for k in ("lower", "compile", "step_ms")}
         for name, rs in results.items()}
  for name, m in med.items():
    losses = ", ".join(f"{r['first_loss']:.6f}" for r in results[name])
    print(f"{name:10s} lower {m['lower']:5.2f} s  compile {m['compile']:6.2f} s  step "
          f"{m['step_ms']:7.1f} ms  first-step losses {losses}")
  print(f"step suite / reference: {med['suite']['step_ms'] / med['reference']['step_ms']:.2f}x")
  print(f"compile reference / suite: {med['reference']['compile'] / med['suite']['compile']:.2f}x")


if __name__ == "__main__":
  main()
