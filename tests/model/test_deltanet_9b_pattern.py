"""A real-layout Qwen3.5 checkpoint at the 9B widths with slow-decay DeltaNet heads.

Qwen3.5-9B (transformers' `Qwen3_5TextConfig` defaults, the published config.json): hidden
4096; DeltaNet 16 key heads x 128, 32 value heads x 128, conv kernel 4; attention 16 query /
4 KV heads x 256, partial rotary 0.25, rope_theta 1e7. Depth is reduced to one 3:1 block (L L L
F). The default-suite version also reduces vocab_size (248320 -> 1024) and intermediate_size
(12288 -> 512) to stay fast and memory-light; the slow version keeps the full intermediate size.
Every DeltaNet head decays slowly (log decay ~ -0.01 per token), the regime where the old UT
inverse blew up on repeated tokens (issue 11, found #1) and padding turned logprobs into NaN
(found #2).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bat_jax.grpo.logprobs import taken_token_logprobs
from bat_jax.model import load_pretrained
from hf_fixtures import build_torch_model, jit_call, qwen3_5_multimodal_config, torch_logits

L, F = "linear_attention", "full_attention"
LOG_DECAY = -0.01


def nine_b_pattern(*, vocab_size: int, intermediate_size: int) -> dict:
  """Qwen3.5-9B text widths, 4 layers, in the multimodal checkpoint layout the 9B ships in."""
  return qwen3_5_multimodal_config(
      vocab_size=vocab_size, hidden_size=4096, intermediate_size=intermediate_size,
      num_hidden_layers=4, layer_types=[L, L, L, F], num_attention_heads=16,
      num_key_value_heads=4, head_dim=256,
      rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
      linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
      linear_num_key_heads=16, linear_num_value_heads=32, max_position_embeddings=4096,
      tie_word_embeddings=False)


def slow_decay_model(hf_dict: dict) -> torch.nn.Module:
  """Random transformers model whose DeltaNet log decay -exp(A_log) softplus(a + dt_bias) is
  ~ LOG_DECAY for every head and token (a ~ 0: tiny in_proj_a, dt_bias 0)."""
  model = build_torch_model(hf_dict, seed=0)
  gen = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, module in model.named_modules():
      if name.endswith("linear_attn"):
        module.in_proj_a.weight.normal_(0.0, 1e-4, generator=gen)
        module.dt_bias.zero_()
        jitter = 0.1 * torch.randn(module.A_log.shape, generator=gen)
        module.A_log.copy_(math.log(-LOG_DECAY / math.log(2.0)) + jitter)
  return model


def check_9b_pattern(tmp_path, *, vocab_size: int, intermediate_size: int,
                     pad: int | None) -> None:
  """Logits vs transformers on [identical tokens; random tokens] of 100; then real-token
  logprobs of 40 tokens with padding: 60 pads through the same compiled forward, and, when `pad`
  is given, `pad` pads through `taken_token_logprobs` (the training path)."""
  torch_model = slow_decay_model(nine_b_pattern(vocab_size=vocab_size,
                                                intermediate_size=intermediate_size))
  torch_model.save_pretrained(tmp_path)  # safetensors
  model = load_pretrained(tmp_path)
  rng = np.random.default_rng(0)
  # Row 0: 100 identical tokens (a full 64-token chunk of them, then a ragged second chunk);
  # row 1: random tokens past one chunk.
  ids = np.stack([np.full(100, 7), rng.integers(0, vocab_size, 100)]).astype(np.int32)
  want = torch_logits(torch_model, ids).numpy()
  del torch_model
  everything = jnp.ones(ids.shape, bool)
  got = np.asarray(jit_call(model, jnp.asarray(ids), valid=everything))
  assert np.isfinite(got).all()
  err = np.abs(got - want).max(axis=(1, 2))
  assert err.max() <= 1e-4, f"max |logits - transformers| identical row {err[0]}, random {err[1]}"

  # The first 40 tokens of each row, then 60 pad tokens (the pad id repeated: identical tokens).
  # By causality the unpadded 40-token logprobs are the first 40 of the 100-token run.
  padded = np.where(np.arange(100) < 40, ids, 0)
  got_pad = np.asarray(jit_call(model, jnp.asarray(padded),
                                valid=jnp.asarray(np.arange(100) < 40)[None].repeat(2, 0)))
  taken = lambda logits: np.take_along_axis(jax.nn.log_softmax(logits[:, :39]),
                                            ids[:, 1:40, None], -1)
  assert np.isfinite(got_pad).all()
  assert np.abs(taken(got_pad) - taken(got)).max() <= 1e-5
  if pad is None:
    return
  real = ids[1, :40]
  long_pad = np.concatenate([real, np.zeros(pad, np.int32)])[None]
  # The logprob chunk (32) splits both lengths alike, so only the padding differs.
  logp_fn = nnx.jit(lambda m, x, v: taken_token_logprobs(m, x, valid=v, chunk_size=32)[0])
  with jax.default_matmul_precision("highest"):
    alone = np.asarray(logp_fn(model, jnp.asarray(real[None]), jnp.ones((1, 40), bool)))
    with_pad = np.asarray(logp_fn(model, jnp.asarray(long_pad),
                                  jnp.asarray(np.arange(40 + pad) < 40)[None]))
    # The same 1,040 tokens with nothing masked: by causality the first 40 logprobs are the
    # same maths, and the same program shape, so masking must change no bit of them.
    unmasked = np.asarray(logp_fn(model, jnp.asarray(long_pad), jnp.ones((1, 40 + pad), bool)))
  assert np.isfinite(with_pad).all() and np.all(with_pad[:, 40:] == 0.0)
  np.testing.assert_array_equal(with_pad[:, :40], unmasked[:, :40])
  # Against the 40-token program only fp32 rounding differs (its matmuls are other shapes: 24
  # pad tokens alone move them by ~2e-5 at width 4,096, each run is ~1-3e-5 from float64), so
  # the bound is relative: 1e-5 of each logprob.
  np.testing.assert_allclose(with_pad[:, :40], alone, rtol=1e-5, atol=1e-6)


def test_9b_widths_slow_decay_match_transformers_and_ignore_padding(tmp_path):
  check_9b_pattern(tmp_path, vocab_size=1024, intermediate_size=512, pad=None)


@pytest.mark.slow
def test_9b_widths_slow_decay_1000_pad_tokens(tmp_path):
  check_9b_pattern(tmp_path, vocab_size=1024, intermediate_size=512, pad=1000)


@pytest.mark.slow
def test_9b_widths_full_intermediate(tmp_path):
  check_9b_pattern(tmp_path, vocab_size=4096, intermediate_size=12288, pad=1000)
