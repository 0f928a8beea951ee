"""Tiny models shared by the rollout tests (built in-process, no downloads)."""

from __future__ import annotations

import jax
from flax import nnx

from bat_jax.model import ModelConfig, build_model
from bat_jax.rollout.jax_engine import JaxEngineConfig

# A 2-layer hybrid (one Gated DeltaNet, one gated-attention layer): exercises both cache kinds.
HYBRID = dict(model_type="qwen3_5_text", hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              layer_types=("linear_attention", "full_attention"), linear_key_head_dim=8,
              linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_conv_kernel_dim=4, partial_rotary_factor=0.5, tie_word_embeddings=False,
              deltanet_chunk_size=8)

# Engine shapes shared by the tests (same static args -> compiled once per pytest process).
SMALL_ENGINE = JaxEngineConfig(num_slots=4, max_len=96, prefill_chunk=16, decode_block=8)
LONG_ENGINE = JaxEngineConfig(num_slots=4, max_len=2048, prefill_chunk=256, decode_block=8)


def tiny_model(vocab_size: int, seed: int = 0, *, scale: float = 10.0, **overrides):
  """A random tiny model with its matrices scaled up so greedy outputs are not constant.

  At the default 0.02 init a 2-layer residual stream is dominated by the input embedding and
  greedy decoding repeats one token, which would make generation tests weak.
  """
  cfg = ModelConfig(vocab_size=vocab_size, **{**HYBRID, **overrides})
  model = build_model(cfg, rngs=nnx.Rngs(seed))
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, params))
  return model
