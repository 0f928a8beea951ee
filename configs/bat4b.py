r"""BaT-4B: the BaT reference recipe on a local Qwen3.5-4B checkpoint, SGLang rollouts, 8 GPUs.

  python launch.py --config=configs/bat4b.py:ckpt=/models/Qwen3.5-4B --workdir=/runs/bat4b
  # several hosts (run on each; jax.distributed finds the coordinator on SLURM / GKE):
  python launch.py --config=configs/bat4b.py:ckpt=/models/Qwen3.5-4B,hosts=2 --workdir=...

The recipe is shared with the other size: `configs/qwen_reference.py`.
"""

from __future__ import annotations

from typing import Optional

import ml_collections

from configs import qwen_reference


def get_config(arg: Optional[str] = None) -> ml_collections.ConfigDict:
  """`arg`: `ckpt=DIR` (local Qwen3.5-4B with tokenizer files), `hosts=N`."""
  return qwen_reference.get_reference_config("4B", arg)
