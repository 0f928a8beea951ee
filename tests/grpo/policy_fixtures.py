"""Tiny policies and synthetic batches shared by the step tests.

XLA's CPU compile time dominates these tests, so the default policy is a one-layer Qwen3;
`hybrid=True` gives the Qwen3.5 DeltaNet + attention stack.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from bat_jax.model import ModelConfig, build_model

VOCAB = 61


def tiny_config(hybrid: bool = False, **overrides) -> ModelConfig:
  if not hybrid:
    overrides = dict(model_type="qwen3", num_hidden_layers=1, layer_types=("full_attention",),
                     **overrides)
  kw = dict(model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            layer_types=("linear_attention", "full_attention"), partial_rotary_factor=0.5,
            linear_key_head_dim=4, linear_value_head_dim=4, linear_num_key_heads=2,
            linear_num_value_heads=2, deltanet_chunk_size=4, max_position_embeddings=128)
  kw.update(overrides)
  return ModelConfig(**kw)


def tiny_model(seed: int = 0, hybrid: bool = False, **overrides):
  return build_model(tiny_config(hybrid, **overrides), rngs=nnx.Rngs(seed))


def grpo_batch(seed: int, batch: int = 8, length: int = 12) -> dict[str, np.ndarray]:
  """Prompt of 4 tokens, then a response of random length with loss mask 1."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, VOCAB, (batch, length), dtype=np.int32)
  ends = rng.integers(6, length + 1, batch)
  mask = ((np.arange(length)[None] >= 4) & (np.arange(length)[None] < ends[:, None]))
  valid = np.arange(length)[None] < ends[:, None]  # right padding after the response
  return {"input_ids": ids, "valid": valid, "loss_mask": mask.astype(np.float32),
          "old_logp": (-3.0 + 0.3 * rng.normal(size=(batch, length))).astype(np.float32) * mask,
          "advantages": rng.normal(size=batch).astype(np.float32)}


def sft_examples(num: int = 24, seed: int = 0) -> list[tuple[list[int], list[int]]]:
  """Random `(ids, loss_mask)` conversations of 8..16 tokens; the last 2..5 are the target."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num):
    length = int(rng.integers(8, 17))
    target = int(rng.integers(2, 6))
    ids = rng.integers(1, VOCAB, length).tolist()
    out.append((ids, [0] * (length - target) + [1] * target))
  return out
