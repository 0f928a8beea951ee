"""Forward-only taken-token logprob passes (old policy, KL reference) on the step's layout.

The pass scans the batch in the step's micro-batches (`split_micro_batches`, same strided rows),
takes the step's batch shardings and the params' NamedShardings, and casts the weights like the
step does, so its peak memory is one micro-batch's forward, never the whole batch (the review
found 67.7 GiB temp for a whole-batch pass at 4 layers, 8k tokens, batch 32). Remat is moot in a
forward-only program (nothing is kept for a backward), so none is applied.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
from flax import nnx

from bat_jax.grpo.logprobs import taken_token_logprobs
from bat_jax.train.step import Batch, cast_floating, merge_micro_batches, split_micro_batches

Array = jax.Array
# Batch keys a logprob pass reads; everything else in a training batch is ignored.
INPUT_KEYS = ("input_ids", "valid", "positions")


@dataclasses.dataclass(frozen=True)
class LogprobPassConfig:
  """Options of one pass.

  Attributes:
    num_micro_batches: scanned micro-batches (the train step's count).
    chunk_size: sequence chunk of the logprob matmul scan.
    temperature: the sampling temperature (logits are divided by it).
    weight_dtype: dtype the params are cast to before the forward (None: as stored).
  """
  num_micro_batches: int = 1
  chunk_size: int = 512
  temperature: float = 1.0
  weight_dtype: Optional[str] = None


def pass_inputs(batch: Batch) -> dict[str, Any]:
  """The keys of `batch` a logprob pass reads."""
  return {k: batch[k] for k in INPUT_KEYS if k in batch}


def build_logprob_fn(graphdef: nnx.GraphDef,
                     cfg: LogprobPassConfig) -> Callable[[Any, Any, Batch], Array]:
  """The pure pass `(params, rest, inputs) -> logp [B, T]` (float32, column 0 is 0).

  `inputs` holds `input_ids [B, T]` and optionally `valid [B, T]` (right-padding mask) and
  `positions [B, T]`.
  """

  def logprobs(params, rest, inputs: Batch) -> Array:
    micro = split_micro_batches(dict(inputs), cfg.num_micro_batches)
    model = nnx.merge(graphdef, cast_floating(params, cfg.weight_dtype), rest)

    def body(carry, mb):
      logp, _ = taken_token_logprobs(model, mb["input_ids"], positions=mb.get("positions"),
                                     valid=mb.get("valid"), chunk_size=cfg.chunk_size,
                                     temperature=cfg.temperature)
      return carry, logp

    _, logp = jax.lax.scan(body, None, micro)   # [M, B/M, T]
    return merge_micro_batches(logp)

  return logprobs
