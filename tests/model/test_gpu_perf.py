"""GPU only: bf16 forward throughput and MFU of a ~1B-class random Qwen3.5 config."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bat_jax.model import ModelConfig, build_model

# Dense bf16 peak FLOP/s by device kind (vendor datasheets, no sparsity).
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def _one_b_config() -> ModelConfig:
  layers = 24
  return ModelConfig(
      model_type="qwen3_5_text", vocab_size=248320, hidden_size=2048, intermediate_size=4096,
      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
      layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(layers)),
      partial_rotary_factor=0.25, rope_theta=1e7, tie_word_embeddings=True,
      linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
      linear_value_head_dim=128, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)


def forward_flops_per_token(cfg: ModelConfig, seq: int, num_matmul_params: int) -> float:
  """2 * matmul params + causal attention + DeltaNet chunk terms, per token (forward)."""
  flops = 2.0 * num_matmul_params
  for kind in cfg.layer_types:
    if kind == "full_attention":  # QK^T and PV over on average seq/2 keys
      flops += 4.0 * (seq / 2) * cfg.num_attention_heads * cfg.head_dim
    else:  # intra-chunk QK, KK, PV (+ UT solve) and state read/write per value head
      c, dk, dv = cfg.deltanet_chunk_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
      flops += cfg.linear_num_value_heads * (2.0 * c * (2 * dk + 2 * dv) + 6.0 * dk * dv)
  return flops


@pytest.mark.gpu
def test_bf16_forward_throughput_and_mfu():
  cfg = _one_b_config()
  model = nnx.jit(lambda: build_model(cfg, rngs=nnx.Rngs(0)))()
  params = nnx.state(model, nnx.Param)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  embed = cfg.vocab_size * cfg.hidden_size
  # The timed pass stops at the final hidden states: no embedding matmul, no head.
  matmul_params = n_params - embed * (1 if cfg.tie_word_embeddings else 2)
  assert 1.2e9 < n_params < 2.0e9

  batch, seq = 8, 2048
  ids = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size, jnp.int32)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, x: nnx.merge(graphdef, st).hidden_states(x)[:, -1])
  logits_fn = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)[:, -4:])
  assert bool(jnp.all(jnp.isfinite(logits_fn(state, ids[:, :256]))))
  jax.block_until_ready(fwd(state, ids))
  iters = 5
  start = time.perf_counter()
  for _ in range(iters):
    out = fwd(state, ids)
  jax.block_until_ready(out)
  step_s = (time.perf_counter() - start) / iters
  tokens_per_s = batch * seq / step_s
  flops = forward_flops_per_token(cfg, seq, matmul_params) * tokens_per_s
  kind = jax.devices()[0].device_kind
  peak = next((v for k, v in _PEAK_BF16.items() if k in kind), None)
  mfu = flops / peak if peak else float("nan")
  print(f"\n[gpu-perf] {kind}: {n_params / 1e9:.2f}B params, bf16 forward B={batch} T={seq}: "
        f"{tokens_per_s:,.0f} tokens/s, {flops / 1e12:.1f} TFLOP/s, MFU={mfu:.1%}")
  assert tokens_per_s > 0 and bool(jnp.all(jnp.isfinite(out)))
