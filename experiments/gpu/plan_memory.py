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


def main(argv) -> int:
  del argv
  import jax
  # memory_plan defines the flags; its parsed values are read through its flag holders.
  cfg = memory_plan._CONFIG.value  # pylint: disable=protected-access
  result = memory_plan.plan(cfg, memory_plan._LAYERS.value)  # pylint: disable=protected-access
  result["backend"] = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
  print(memory_plan.format_table(result), flush=True)
  if memory_plan._JSON.value:  # pylint: disable=protected-access
    Path(memory_plan._JSON.value).write_text(json.dumps(result, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
