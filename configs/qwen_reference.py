r"""The BaT-4B / BaT-9B reference runs: one recipe, the model size its only argument.

`bat4b.py` and `bat9b.py` are thin `get_config`s over `get_reference_config(size, arg)`. The recipe
itself (SFT, GRPO, limits, Stage Bank round view, gate, argmin curriculum) is `configs/base.py`'s
defaults, checked against the release's bat-reference.json by tests/configs.
"""

from __future__ import annotations

from typing import Optional

import ml_collections

from configs import base

SIZES = ("4B", "9B")


def default_checkpoint(size: str) -> str:
  """Where the example commands expect the local Qwen3.5-`size` checkpoint (`ckpt=` overrides)."""
  return f"/models/Qwen3.5-{size}"


def get_reference_config(size: str, arg: Optional[str] = None) -> ml_collections.ConfigDict:
  """BaT-`size` (4B | 9B): the reference recipe on a local Qwen3.5 checkpoint, 8 GPUs per host.

  Trainer and SGLang share each host's 8 GPUs (8 rollout replicas, TP 1, as in the release), so
  both memory fractions are set. Params, grads and AdamW state are FSDP-sharded over the 8 GPUs
  of a host; `data` spans hosts (jax.distributed). `arg`: `ckpt=DIR` (the local checkpoint,
  tokenizer files included), `hosts=N` (processes for jax.distributed; 1 = single host).
  """
  if size not in SIZES:
    raise ValueError(f"unknown BaT size {size!r}; expected one of {SIZES}")
  arg = base.parse_arg(arg, ckpt=default_checkpoint(size), hosts=1)
  c = base.base_config()
  c.model.source = "pretrained"
  c.model.path = arg.ckpt
  c.tokenizer.source = "pretrained"
  c.tokenizer.path = arg.ckpt
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 8, 1
  c.distributed.enabled = arg.hosts > 1
  if arg.hosts > 1:
    c.distributed.num_processes = arg.hosts
  c.trainer.weight_dtype = "bfloat16"     # bf16 gathers and matmuls, fp32 master weights
  c.trainer.reference_dtype = "bfloat16"  # the frozen KL reference
  c.rollout.limits.max_context_tokens = base.trajectory_token_cap(c.rollout.limits)
  c.rollout.jax.max_len = c.rollout.limits.max_context_tokens
  # One 8x80 GB node, time-shared (README "GPU memory layout"): SGLang releases its weights and
  # KV pool around every train step; JAX keeps no pool, so between steps it holds only params,
  # moments and the bf16 reference (14.6 GiB per GPU at 9B), and SGLang's static share (60% of
  # the GPU, taken at start-up while JAX holds nothing) fits beside them.
  c.memory.layout = "timeshare"
  c.memory.device_gib = 79.6             # what an 80 GB card reports
  c.memory.rollout_reserved_gib = 4.0
  c.distributed.xla_mem_fraction = None
  c.rollout.engine = "sglang"
  c.rollout.sglang.python = ".venv-sglang/bin/python"
  c.rollout.sglang.release_memory = True  # timeshare: weights + KV pool freed around each train step
  c.rollout.sglang.mem_fraction_static = 0.6
  c.rollout.sglang.tp_size = 1
  c.rollout.sglang.dp_size = 8
  # A micro-batch must split over all hosts x 8 GPUs (`data` x `fsdp`; config validation refuses
  # one that does not): on N hosts the accumulation steps shrink N-fold, so each GPU still takes
  # one row per micro-batch and the global batch stays the recipe's.
  for section in (c.sft, c.grpo):
    if section.micro_batches % arg.hosts == 0:
      section.micro_batches //= arg.hosts
  c.lock()
  return c
