"""Building blocks shared by the Qwen3 and Qwen3.5 decoders (Flax NNX).

Every parameter carries its logical axis names as NNX metadata
(`out_sharding`, e.g. `("embed", "mlp")`); the logical -> mesh mapping lives in
`bat_jax.sharding` rules only. Parameters are stored in `param_dtype` and cast
to the compute `dtype` at use.

Linear kernels are stored `[in, out]` (the transpose of torch's `[out, in]`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from bat_jax import sharding
from bat_jax.model.attention import AttentionMask, attend, attend_cached

def logical_param(value: jax.Array, axes: Sequence[str | None]) -> nnx.Param:
  """A Param annotated with logical axis names (no eager sharding)."""
  if len(axes) != value.ndim:
    raise ValueError(f"logical axes {tuple(axes)} do not match param shape {value.shape}")
  return nnx.Param(value, sharding_names=tuple(axes), eager_sharding=False)


def compute_param(var: nnx.Variable, dtype) -> jax.Array:
  """The param's value in the compute `dtype`, cast where it is stored.

  Under `sharding.activation_sharding` the cast copy is pinned to the param's
  own (sharded) layout, so the cast runs on each shard and the all-gather in
  front of the matmul moves compute-dtype (bf16) bytes, not fp32 masters.
  Stacked (scanned) params are sliced per layer, so only the trailing axes
  of the metadata apply.
  """
  value = var[...]
  if value.dtype == jnp.dtype(dtype):
    return value
  cast = value.astype(dtype)
  axes = var.get_metadata().get("out_sharding")
  return sharding.constrain(cast, axes[len(axes) - cast.ndim:]) if axes else cast


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
  """y = x @ kernel (+ bias). kernel: [in, out]."""

  def __init__(self, in_features: int, out_features: int, *, axes: tuple[str | None, str | None],
               use_bias: bool = False, dtype, param_dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    self.kernel = logical_param(_normal(rngs, (in_features, out_features), param_dtype), axes)
    self.bias = (logical_param(jnp.zeros((out_features,), param_dtype), axes[1:])
                 if use_bias else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    # A rank-2 [N, in] @ [in, out] matmul (leading dims merged, batch-major, so a batch
    # sharding carries over): its weight gradient is then one plain [in, N] @ [N, out] dot.
    # With [B, T, in] XLA:CPU contracts two dims and a SwiGLU MLP's fwd+bwd ran ~2x slower.
    kernel = compute_param(self.kernel, self.dtype)
    y = jnp.dot(x.astype(self.dtype).reshape(-1, x.shape[-1]), kernel)
    y = y.reshape(*x.shape[:-1], kernel.shape[-1])
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) over the last axis, computed in fp32 (returns fp32)."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis, computed in fp32.

  `zero_centered=True` is the Qwen3.5 convention: `x_hat * (1 + w)` with w
  initialised to 0, product taken in fp32 then cast. Otherwise (Qwen3):
  `w * x_hat` with w initialised to 1, x_hat cast to the input dtype first.
  """

  def __init__(self, dim: int, *, eps: float, zero_centered: bool, param_dtype,
               axis_name: str = "norm"):
    self.eps = eps
    self.zero_centered = zero_centered
    init = jnp.zeros if zero_centered else jnp.ones
    self.weight = logical_param(init((dim,), param_dtype), (axis_name,))

  def __call__(self, x: jax.Array) -> jax.Array:
    normed = rms_normalize(x, self.eps)
    w = self.weight[...]
    if self.zero_centered:
      return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w.astype(x.dtype) * normed.astype(x.dtype)


class Embed(nnx.Module):
  """Token embedding table [V, D]."""

  def __init__(self, vocab_size: int, dim: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    self.embedding = logical_param(_normal(rngs, (vocab_size, dim), param_dtype),
                                   ("vocab", "embed"))

  def __call__(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, dim: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate_proj = Linear(dim, hidden, axes=("embed", "mlp"), **kw)
    self.up_proj = Linear(dim, hidden, axes=("embed", "mlp"), **kw)
    self.down_proj = Linear(hidden, dim, axes=("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


# -- RoPE -----------------------------------------------------------------------


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos/sin tables for (possibly partial) rotary embeddings.

  Args:
    positions: [B, T] int positions.
    rotary_dim: number of leading head dims that rotate (even).
    theta: RoPE base.
  Returns:
    (cos, sin), each [B, T, rotary_dim] fp32, halves duplicated (HF layout).
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rotary_dim/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates the first `cos.shape[-1]` dims of x ([B, T, H, Dh]); rest passes."""
  rot = cos.shape[-1]
  x_rot, x_pass = x[..., :rot].astype(jnp.float32), x[..., rot:]
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  half = rot // 2
  rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
  out = (x_rot * c + rotated * s).astype(x.dtype)
  return jnp.concatenate([out, x_pass], axis=-1)


# -- attention ------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """KV cache of one full-attention layer: key [B, K, Dh, S], value [B, K, S, Dh].

  Laid out as the cached attention's two matmuls read them (batch dims (B, K) major, then
  q.k's contraction Dh, then p.v's contraction S), so a decode step reads the cache where it
  lies: the [B, S, K, Dh] layout made XLA transpose every attended slot of every layer on every
  step (2.4 vs 0.9 ms a layer for 16 rows x 1,536 slots on CPU).
  """

  key: jax.Array
  value: jax.Array


class Attention(nnx.Module):
  """GQA self-attention with per-head q/k RMSNorm and (partial) RoPE.

  With `output_gate` (Qwen3.5), q_proj also emits a per-head sigmoid gate laid
  out `[H, 2 * Dh]` = (query, gate) per head, multiplied into the output.
  `attention_impl` / `block_size` pick the softmax kernel (see
  `bat_jax.model.attention.attend`); they do not change the parameters.
  """

  def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
               rotary_dim: int, rope_theta: float, eps: float, zero_centered_norm: bool,
               output_gate: bool, use_bias: bool, dtype, param_dtype, rngs: nnx.Rngs,
               attention_impl: str | None = None, block_size: int = 512):
    self.attention_impl, self.block_size = attention_impl, block_size
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.rotary_dim, self.rope_theta = rotary_dim, rope_theta
    self.output_gate = output_gate
    kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    q_out = num_heads * head_dim * (2 if output_gate else 1)
    self.q_proj = Linear(hidden_size, q_out, axes=("embed", "heads"), **kw)
    self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, axes=("embed", "kv_heads"), **kw)
    self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, axes=("embed", "kv_heads"), **kw)
    self.o_proj = Linear(num_heads * head_dim, hidden_size, axes=("heads", "embed"), **kw)
    norm_kw = dict(eps=eps, zero_centered=zero_centered_norm, param_dtype=param_dtype)
    self.q_norm = RMSNorm(head_dim, **norm_kw)
    self.k_norm = RMSNorm(head_dim, **norm_kw)

  def __call__(self, x: jax.Array, *, positions: jax.Array, mask: AttentionMask,
               cache: KVCache | None = None, write_slots: jax.Array | None = None
               ) -> tuple[jax.Array, KVCache | None]:
    """Self-attention over the chunk (no cache) or over the updated cache.

    Args:
      x: [B, T, D].
      positions: [B, T] RoPE positions.
      mask: visibility of key slots (S = T without cache, cache length with).
      cache: KV cache of this layer, or None.
      write_slots: [B, T] cache slot per token; out-of-range slots are dropped
        (used for invalid tokens, which must not touch the cache).
    Returns:
      ([B, T, D], updated cache or None).
    """
    k, v = self.keys_values(x, positions=positions)
    if cache is None:
      return self.attend_to(x, positions=positions, key=k, value=v, mask=mask), None
    rows = jnp.arange(x.shape[0])[:, None]
    # Advanced indices (rows, slots) around sliced axes index [B, T, K, Dh], as k and v are.
    new_cache = KVCache(
        key=cache.key.at[rows, :, :, write_slots].set(k.astype(cache.key.dtype), mode="drop"),
        value=cache.value.at[rows, :, write_slots].set(v.astype(cache.value.dtype),
                                                       mode="drop"))
    # The mask's width is the span of cache slots attended (`hidden_states(attend_span=)`).
    span = mask.key_valid.shape[1]
    key_t, value = new_cache.key[..., :span], new_cache.value[:, :, :span]
    return self.attend_to(x, positions=positions, key=key_t, value=value, mask=mask,
                          cached=True), new_cache

  def keys_values(self, x: jax.Array, *, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Normed, rotated keys and values of x [B, T, D]: each [B, T, K, Dh]."""
    b, t, _ = x.shape
    kv, dh = self.num_kv_heads, self.head_dim
    k = self.k_norm(self.k_proj(x).reshape(b, t, kv, dh))
    v = self.v_proj(x).reshape(b, t, kv, dh)
    cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta)
    return apply_rope(k, cos, sin), v

  def attend_to(self, x: jax.Array, *, positions: jax.Array, key: jax.Array, value: jax.Array,
                mask: AttentionMask, cached: bool = False) -> jax.Array:
    """Queries of x [B, T, D] attend to key / value [B, S, K, Dh] under `mask` (`cached`: in
    the cache's layout, see `KVCache`); the gated, projected output [B, T, D].
    (Sequence-tiled layers pass one query tile at a time.)"""
    b, t, _ = x.shape
    h, dh = self.num_heads, self.head_dim
    q = self.q_proj(x)
    gate = None
    if self.output_gate:
      q = q.reshape(b, t, h, 2 * dh)
      q, gate = q[..., :dh], q[..., dh:].reshape(b, t, h * dh)
    q = self.q_norm(q.reshape(b, t, h, dh))
    cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta)
    q = apply_rope(q, cos, sin)
    attend_fn = attend_cached if cached else attend
    out = attend_fn(q, key.astype(q.dtype), value.astype(q.dtype), mask,
                    impl=self.attention_impl, block_size=self.block_size).reshape(b, t, h * dh)
    if gate is not None:
      out = out * jax.nn.sigmoid(gate)
    return self.o_proj(out)
