r"""The memory plan's programs compiled on the real backend (GPU), for comparison with the plan.

`python -m bat_jax.memory_plan` always compiles on fake CPU devices. This runs the same
`memory_plan.plan(cfg, num_layers)` on whatever backend JAX has (the GPU), so check.sh can put
the GPU's compiled temp / peak beside the CPU plan's figure for one config (use a mesh that fits
the machine, e.g. `--config.mesh.fsdp=1`). Takes memory_plan's own flags.

  PYTHONPATH=. python experiments/gpu/plan_memory.py --config=configs/bat9b.py \
      --config.mesh.fsdp=1 --num_layers=4 --json=gpu_plan.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

try:
  from bat_jax import memory_plan
except ImportError as e:  # the memory plan lands with issue 11's trainer work
  print(f"memory plan: not available ({e})")
  sys.exit(0)

from absl import app


def main(argv, held: "memory_plan.PlanFlags") -> int:
  del argv
  import jax
  cfg = held.config.value
  result = memory_plan.plan(cfg, held.num_layers.value)
  result["backend"] = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
  print(memory_plan.format_table(result), flush=True)
  if held.json.value:
    Path(held.json.value).write_text(json.dumps(result, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  _HELD = memory_plan.define_flags()
  app.run(lambda argv: sys.exit(main(argv, _HELD)))
