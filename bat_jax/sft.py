"""Cold-start SFT: next-token NLL on the final target assistant action only.

The examples come from `ChatFormat.encode_sft_example(messages, target_action) -> (ids,
loss_mask)`, whose mask is 1 only on the target action's tokens (its end token included); context,
earlier assistant turns, tool observations and padding are 0. This module only consumes masks.

SFT reuses the GRPO step machinery (`bat_jax.grpo.train_step.build_step_fn`): only the objective
differs. `run_sft` is the resumable loop (orbax checkpoints of the train state and of the grain
iterator position), killable at any point and resumable bit-identically.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax.checkpointing import Checkpointer
from bat_jax.grpo.logprobs import taken_token_logprobs
from bat_jax.grpo.train_step import (Batch, OptimizerConfig, RematPolicy, StepConfig,
                                     StepShardings, TrainState, build_step_fn, init_train_state,
                                     make_optimizer, make_train_step, split_model)

Example = tuple[Sequence[int], Sequence[int]]  # (ids, loss_mask) of one conversation


def sft_loss_fn(*, chunk_size: int = 512):
  """A `LossFn`: masked token NLL as `(sum, token count)` (token-mean over the global batch)."""

  def loss_fn(model: nnx.Module, batch: Batch, ref_model: Optional[nnx.Module],
              remat_policy: RematPolicy = None):
    del ref_model
    for key in ("input_ids", "loss_mask", "valid"):
      if key not in batch:
        raise ValueError(f"SFT batch is missing key {key!r}; has {sorted(batch)}")
    if batch["loss_mask"].shape != batch["input_ids"].shape:
      raise ValueError(f"batch['loss_mask'] {batch['loss_mask'].shape} != batch['input_ids'] "
                       f"{batch['input_ids'].shape}")
    logp, _ = taken_token_logprobs(model, batch["input_ids"], valid=batch["valid"],
                                   positions=batch.get("positions"),
                                   chunk_size=chunk_size, remat_policy=remat_policy)
    mask = batch["loss_mask"].astype(jnp.float32)
    nll = -(logp * mask).sum()
    return nll, mask.sum(), {"tokens": mask.sum(), "nll_sum": nll}

  return loss_fn


def pad_example(ids: Sequence[int], loss_mask: Sequence[int], *, max_len: int,
                pad_id: int) -> dict[str, np.ndarray]:
  """Right-pads one example to `max_len` (padding mask 0).

  Raises:
    ValueError: ids/mask lengths differ, the example exceeds `max_len`, or the mask is 1 on the
      first token (it has no prefix to be predicted from).
  """
  ids = np.asarray(ids, np.int32)
  mask = np.asarray(loss_mask, np.int32)
  if ids.shape != mask.shape or ids.ndim != 1:
    raise ValueError(f"ids {ids.shape} and loss_mask {mask.shape} must be equal 1-D sequences")
  if len(ids) > max_len:
    raise ValueError(f"example has {len(ids)} tokens > max_len={max_len}; filter it first "
                     "(see drop_too_long)")
  if len(mask) and mask[0]:
    raise ValueError("loss_mask[0] is 1, but the first token has no prefix to predict it")
  pad = max_len - len(ids)
  return {"input_ids": np.pad(ids, (0, pad), constant_values=pad_id),
          "loss_mask": np.pad(mask, (0, pad)),
          "valid": (np.arange(max_len) < len(ids)).astype(np.int32)}


def drop_too_long(examples: Sequence[Example], max_len: int) -> tuple[list[Example], list[int]]:
  """Splits off examples longer than `max_len`; returns `(kept, dropped indices)`."""
  kept, dropped = [], []
  for i, (ids, mask) in enumerate(examples):
    (kept.append((ids, mask)) if len(ids) <= max_len else dropped.append(i))
  return kept, dropped


def sft_dataset(examples: Sequence[Example], *, batch_size: int, max_len: int, seed: int,
                pad_id: int = 0) -> grain.MapDataset:
  """Shuffled, endlessly repeated, padded `[batch_size, max_len]` batches (a grain MapDataset).

  Its iterator's `get_state()` / `set_state()` give the exact data position for resume.
  """
  if not examples:
    raise ValueError("no SFT examples")
  for i, (_, mask) in enumerate(examples):
    if not np.any(np.asarray(mask)):
      raise ValueError(f"SFT example {i} has an all-zero loss_mask (no target tokens)")
  padded = [pad_example(ids, mask, max_len=max_len, pad_id=pad_id) for ids, mask in examples]
  return (grain.MapDataset.source(padded).shuffle(seed=seed).repeat(None)
          .batch(batch_size, drop_remainder=True))


@dataclasses.dataclass(frozen=True)
class SftConfig:
  """Cold-start SFT run options (BaT: lr 2e-5, 200 steps, global batch 32, 8192 tokens)."""
  num_steps: int
  batch_size: int
  max_len: int
  seed: int = 0
  checkpoint_every: int = 10
  keep_checkpoints: int = 3
  logprob_chunk_size: int = 512
  pad_id: int = 0
  optimizer: OptimizerConfig = OptimizerConfig(learning_rate=2e-5)
  step: StepConfig = StepConfig()

  def __post_init__(self):
    for name in ("num_steps", "batch_size", "max_len", "checkpoint_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"SftConfig.{name} must be >= 1, got {getattr(self, name)}")


StepCallback = Callable[[int, Mapping[str, Any]], None]


def run_sft(model: nnx.Module, examples: Sequence[Example], cfg: SftConfig,
            checkpoint_dir: str | Path, *, shardings: Optional[StepShardings] = None,
            on_step: Optional[StepCallback] = None) -> TrainState:
  """Trains `model` in place for `cfg.num_steps`, resuming from the latest checkpoint if any.

  A checkpoint (train state + data position) is saved every `cfg.checkpoint_every` steps and at
  the end; a killed run restarted with the same arguments continues from the latest committed one
  and ends with bit-identical params (same compiled step, same data order).

  Args:
    model: the policy; updated with the final params.
    examples: `(ids, loss_mask)` pairs (see `ChatFormat.encode_sft_example`).
    cfg: run options.
    checkpoint_dir: orbax directory of this run.
    shardings: explicit step shardings (`bat_jax.grpo.step_shardings`), or None for one device.
    on_step: called after every step with `(step, metrics)`.

  Returns:
    The final `TrainState`.
  """
  graphdef, params, rest = split_model(model)
  optimizer = make_optimizer(cfg.optimizer)
  step_fn = build_step_fn(graphdef, sft_loss_fn(chunk_size=cfg.logprob_chunk_size), optimizer,
                          cfg.step)
  train_step = make_train_step(step_fn, shardings)
  state = init_train_state(params, optimizer, seed=cfg.seed)
  frozen = {"rest": rest, "ref_params": None}
  if shardings is not None:
    state, frozen = jax.device_put((state, frozen), (shardings.state, shardings.frozen))
  batches = iter(sft_dataset(examples, batch_size=cfg.batch_size, max_len=cfg.max_len,
                             seed=cfg.seed, pad_id=cfg.pad_id))
  with Checkpointer(checkpoint_dir, max_to_keep=cfg.keep_checkpoints) as ckpt:
    if ckpt.latest_step() is not None:
      restored = ckpt.restore(state)
      state = restored.state
      batches.set_state(restored.data_state)
    step = int(state.step)
    while step < cfg.num_steps:
      state, metrics = train_step(state, next(batches), frozen)
      step = int(state.step)
      if on_step is not None:
        on_step(step, metrics)
      if step % cfg.checkpoint_every == 0 or step == cfg.num_steps:
        ckpt.save(step, state, data_state=batches.get_state())
  nnx.update(model, state.params)
  return state
