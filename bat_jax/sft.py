"""Cold-start SFT: next-token NLL on the final target assistant action (and, optionally, a
weighted next-token loss on the context: `SftConfig.context_loss_weight`).

The examples come from `ChatFormat.encode_sft_example(messages, target_action) -> (ids,
loss_mask)`, whose mask is 1 only on the target action's tokens (its end token included); context,
earlier assistant turns, tool observations and padding are 0. This module only consumes masks.

SFT supplies only a loss (`sft_loss_fn`) and a batch source (a grain iterator) to the shared
trainer (`bat_jax.train.Trainer`), which owns the sharded state, the compiled step and the
resumable loop (orbax checkpoints of the train state and of the grain iterator position),
killable at any point and resumable bit-identically.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax import sharding
from bat_jax.grpo.logprobs import selected_token_logprobs, taken_token_logprobs
from bat_jax.train.step import Batch, OptimizerConfig, RematPolicy, StepConfig, TrainState
from bat_jax.train.trainer import Trainer, TrainerConfig

if TYPE_CHECKING:  # imported where used: the loss alone needs no data pipeline (GPU check)
  import grain

Example = tuple[Sequence[int], Sequence[int]]  # (ids, loss_mask) of one conversation


def sft_loss_fn(*, chunk_size: int = 512, context_weight: float = 0.0,
                targets_per_row: Optional[int] = None):
  """A `LossFn`: masked token NLL as `(sum, token count)` (token-mean over the global batch).

  `targets_per_row` (a bound on any row's loss-mask ones, `max_targets_per_row`) computes the
  head and softmax at the target positions only (`selected_token_logprobs`): the same loss, at
  ~1/8 of the head's cost for SFT rows. A row past the bound would drop targets, so the step
  reports them as `unscored_targets` and `SftBatches` raises.

  `context_weight` > 0 adds the NLL of every other real token after the first (the prompt,
  earlier turns, tool observations) at that weight, to the sum and to the count: a next-token
  loss on the context. A from-scratch policy gets ~10x more gradient per row that way, including
  every place the context repeats a value it stated before (the copying a short call needs).
  The metrics `tokens` / `nll_sum` stay the target action's alone.
  """
  if context_weight < 0:
    raise ValueError(f"context_weight must be >= 0, got {context_weight}")

  def loss_fn(model: nnx.Module, batch: Batch, ref_model: Optional[nnx.Module],
              remat_policy: RematPolicy = None):
    del ref_model
    for key in ("input_ids", "loss_mask", "valid"):
      if key not in batch:
        raise ValueError(f"SFT batch is missing key {key!r}; has {sorted(batch)}")
    if batch["loss_mask"].shape != batch["input_ids"].shape:
      raise ValueError(f"batch['loss_mask'] {batch['loss_mask'].shape} != batch['input_ids'] "
                       f"{batch['input_ids'].shape}")
    mask = batch["loss_mask"].astype(jnp.float32)                        # [B, T]
    if targets_per_row and not context_weight:
      logp, live, overflow = selected_token_logprobs(
          model, batch["input_ids"], valid=batch["valid"], select=batch["loss_mask"],
          per_row=min(targets_per_row, batch["input_ids"].shape[1]),
          positions=batch.get("positions"), chunk_size=chunk_size, remat_policy=remat_policy)
      nll = -logp.sum()    # 0 past each row's targets (`live`)
      return nll, live.sum().astype(jnp.float32), {
          "tokens": mask.sum(), "nll_sum": nll, "unscored_targets": overflow}
    logp, _ = taken_token_logprobs(model, batch["input_ids"], positions=batch.get("positions"),
                                   valid=batch.get("valid"), chunk_size=chunk_size,
                                   remat_policy=remat_policy)
    nll = -(logp * mask).sum()
    metrics = {"tokens": mask.sum(), "nll_sum": nll}
    if not context_weight:
      return nll, mask.sum(), metrics
    # Real tokens outside the target, less each row's first (nothing predicts it).
    context = batch["valid"].astype(jnp.float32) * (1.0 - mask)
    context = context.at[:, 0].set(0.0)                                  # [B, T]
    weights = mask + context_weight * context
    metrics["context_nll_sum"] = -(logp * context).sum()
    return -(logp * weights).sum(), weights.sum(), metrics

  return loss_fn


def pad_example(ids: Sequence[int], loss_mask: Sequence[int], *, max_len: int,
                pad_id: int) -> dict[str, np.ndarray]:
  """Right-pads one example to `max_len`: `input_ids`, `loss_mask` (0 on padding) and `valid`
  (1 on the real tokens), which keeps pad positions out of every real one's forward.

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
          "valid": np.pad(np.ones(len(ids), np.int32), (0, pad))}


def balanced_repeats(kinds: Sequence[Hashable], exponent: float) -> list[int]:
  """How often to repeat each example so that a kind of `n` examples is drawn in proportion to
  `n ** (1 - exponent)`: 0 keeps every example once, 1 gives every kind about the same share.
  Rare decisions (a fix after a fault line: ~3% of the cold-start rows) otherwise go unseen in
  a short SFT run; repetition keeps the data pipeline's shuffle and length buckets as they are.
  """
  if not 0.0 <= exponent <= 1.0:
    raise ValueError(f"balance exponent {exponent} is outside [0, 1]")
  counts = collections.Counter(kinds)
  if not counts:
    return []
  most = max(counts.values())
  return [max(1, round((most / counts[k]) ** exponent)) for k in kinds]


def drop_too_long(examples: Sequence[Example], max_len: int) -> tuple[list[Example], list[int]]:
  """Splits off examples longer than `max_len`; returns `(kept, dropped indices)`."""
  kept, dropped = [], []
  for i, (ids, mask) in enumerate(examples):
    (kept.append((ids, mask)) if len(ids) <= max_len else dropped.append(i))
  return kept, dropped


def length_groups(lengths: Sequence[int], bucket_lengths: Sequence[int], max_len: int,
                  batch_size: int) -> list[tuple[int, list[int]]]:
  """`[(padded length, example indices)]`: each example in the shortest bucket that holds it.

  Buckets are `bucket_lengths` below `max_len`, then `max_len`. A bucket with fewer than
  `batch_size` examples joins the next longer one (the longest joins the one before it), so
  every group fills a batch; each group is one compiled step shape.
  """
  edges = sorted({b for b in bucket_lengths if b < max_len}) + [max_len]
  groups: list[tuple[int, list[int]]] = [(e, []) for e in edges]
  for i, n in enumerate(lengths):
    if n > max_len:
      raise ValueError(f"SFT example {i} has {n} tokens > max_len={max_len}; filter it first")
    next(g for e, g in groups if n <= e).append(i)
  merged: list[tuple[int, list[int]]] = []
  for edge, members in groups:
    carry = merged.pop()[1] if merged and len(merged[-1][1]) < batch_size else []
    merged.append((edge, carry + members))
  while len(merged) > 1 and len(merged[-1][1]) < batch_size:
    edge, members = merged.pop()
    merged[-1] = (edge, merged[-1][1] + members)
  return [(e, sorted(m)) for e, m in merged if m]


def sft_dataset(examples: Sequence[Example], *, batch_size: int, max_len: int, seed: int,
                pad_id: int = 0, bucket_lengths: Sequence[int] = ()) -> grain.MapDataset:
  """Shuffled, endlessly repeated, padded `[batch_size, L]` batches (a grain MapDataset).

  `L` is `max_len`, or with `bucket_lengths` the bucket of the batch (`length_groups`): each
  batch comes from one bucket, buckets mixed in proportion to their examples, so short rows are
  not padded to the longest one's length. Its iterator's `get_state()` / `set_state()` give the
  exact data position for resume.
  """
  if not examples:
    raise ValueError("no SFT examples")
  for i, (_, mask) in enumerate(examples):
    if not np.any(np.asarray(mask)):
      raise ValueError(f"SFT example {i} has an all-zero loss_mask (no target tokens)")
  groups = length_groups([len(ids) for ids, _ in examples], bucket_lengths, max_len, batch_size)
  import grain  # the data pipeline (see the imports)
  parts = [grain.MapDataset.source([pad_example(*examples[i], max_len=length, pad_id=pad_id)
                                    for i in members])
           .shuffle(seed=seed + j).repeat(None).batch(batch_size, drop_remainder=True)
           for j, (length, members) in enumerate(groups)]
  if len(parts) == 1:
    return parts[0]
  return grain.MapDataset.mix(parts, weights=[len(m) for _, m in groups])


@dataclasses.dataclass(frozen=True)
class SftConfig:
  """Cold-start SFT run options (BaT: lr 2e-5, 200 steps, global batch 32, 8192 tokens)."""
  num_steps: int
  batch_size: int
  max_len: int
  bucket_lengths: tuple[int, ...] = ()   # shorter padded lengths (sft_dataset)
  seed: int = 0
  checkpoint_every: int = 10
  keep_checkpoints: int = 3
  logprob_chunk_size: int = 512
  context_loss_weight: float = 0.0       # sft_loss_fn(context_weight=...)
  # The head at each row's target positions only (a bound taken from the examples: run_sft);
  # False computes it at every position, as the context loss must.
  head_on_targets: bool = True
  pad_id: int = 0
  optimizer: OptimizerConfig = OptimizerConfig(learning_rate=2e-5)
  step: StepConfig = StepConfig()

  def __post_init__(self):
    for name in ("num_steps", "batch_size", "max_len", "checkpoint_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"SftConfig.{name} must be >= 1, got {getattr(self, name)}")

  def trainer_config(self) -> TrainerConfig:
    return TrainerConfig(optimizer=self.optimizer, step=self.step, seed=self.seed,
                         checkpoint_every=self.checkpoint_every,
                         keep_checkpoints=self.keep_checkpoints)


StepCallback = Callable[[int, Mapping[str, Any]], None]


class SftBatches:
  """The trainer's batch source for SFT: a grain iterator whose state is the data position."""

  def __init__(self, dataset: grain.MapDataset):
    self._batches = iter(dataset)

  def next_batch(self, trainer: Trainer, state: TrainState) -> Batch:
    del state
    return trainer.place_batch(next(self._batches))  # the same rows on every process

  def record(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    unscored = int(metrics.get("unscored_targets", 0))
    if unscored:
      raise ValueError(f"SFT step {step}: {unscored} target tokens fell past the per-row bound "
                       "of sft_loss_fn(targets_per_row=...); it must cover every example")
    return metrics

  def get_state(self) -> Any:
    return self._batches.get_state()

  def outer_state(self) -> None:
    return None

  def restore(self, data_state: Any, outer_state: Any) -> None:
    del outer_state
    self._batches.set_state(data_state)


def max_targets_per_row(examples: Sequence[Example], multiple: int = 16) -> int:
  """The most loss-mask ones in any example, rounded up to `multiple`: a static per-row bound
  for `sft_loss_fn(targets_per_row=...)` that no batch of these examples can exceed."""
  most = max((int(np.count_nonzero(mask)) for _, mask in examples), default=1)
  return -(-max(most, 1) // multiple) * multiple


def sft_trainer(model: nnx.Module, cfg: SftConfig, mesh: Optional[jax.sharding.Mesh] = None,
                rules: sharding.Rules = sharding.DEFAULT_RULES,
                targets_per_row: Optional[int] = None, **kw) -> Trainer:
  """The SFT `Trainer` for `model` (concrete or abstract); default mesh: the first device.
  `targets_per_row`: see `sft_loss_fn` (None: the head at every position)."""
  if mesh is None:
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
  loss_fn = sft_loss_fn(chunk_size=cfg.logprob_chunk_size,
                        context_weight=cfg.context_loss_weight,
                        targets_per_row=targets_per_row if cfg.head_on_targets else None)
  return Trainer.for_model(model, loss_fn, cfg.trainer_config(), mesh, rules, **kw)


def run_sft(model: nnx.Module, examples: Sequence[Example], cfg: SftConfig,
            checkpoint_dir: str | Path, *, mesh: Optional[jax.sharding.Mesh] = None,
            rules: sharding.Rules = sharding.DEFAULT_RULES,
            make_params: Optional[Callable[[Trainer], Any]] = None,
            on_step: Optional[StepCallback] = None) -> TrainState:
  """Trains `model` for `cfg.num_steps`, resuming from the latest checkpoint if any.

  A checkpoint (train state + data position) is saved every `cfg.checkpoint_every` steps and at
  the end; a killed run restarted with the same arguments continues from the latest committed one
  and ends with bit-identical params (same compiled step, same data order).

  Args:
    model: the policy (concrete, or abstract from `nnx.eval_shape` with `make_params`); updated
      with the final params.
    examples: `(ids, loss_mask)` pairs (see `ChatFormat.encode_sft_example`).
    cfg: run options.
    checkpoint_dir: orbax directory of this run.
    mesh, rules: the layout (default: one device).
    make_params: `trainer -> params`, the initial params, called only when there is no
      checkpoint (default: the model's own, placed on their shards).
    on_step: called after every step with `(step, metrics)`.

  Returns:
    The final `TrainState`.
  """
  trainer = sft_trainer(model, cfg, mesh, rules, targets_per_row=max_targets_per_row(examples))
  if make_params is None:
    make_params = lambda t: nnx.state(model, nnx.Param)
  source = SftBatches(sft_dataset(examples, batch_size=cfg.batch_size, max_len=cfg.max_len,
                                  seed=cfg.seed, pad_id=cfg.pad_id,
                                  bucket_lengths=cfg.bucket_lengths))
  state = trainer.fit(checkpoint_dir, cfg.num_steps, source, lambda: make_params(trainer),
                      on_step)
  nnx.update(model, state.params)
  return state
