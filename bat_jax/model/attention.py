"""Causal grouped-query softmax attention kernels (pure functions).

Three implementations share one signature (`attend`):

* `xla`: dense logits in XLA; fastest for short sequences and decode steps.
  A cache-free causal chunk runs in query blocks that skip the keys above the
  diagonal (`causal_block_attention`); other masks go through
  `jax.nn.dot_product_attention(implementation="xla")` with a dense mask.
* `cudnn`: cuDNN flash attention through `jax.nn.dot_product_attention`
  (GPU, bf16/fp16, cache-free causal chunks with right padding only).
* `chunked`: blockwise online-softmax attention in pure JAX (any backend):
  query blocks scanned with `lax.scan`, key blocks folded into a running
  max / sum, each block body under `jax.checkpoint`, so forward and backward
  peak at `[B, H, block, block]` logits instead of `[B, H, T, S]`.

`attend_cached` is `attend` over a decode cache in its own layout (`KVCache`).

Visibility is described by an `AttentionMask` (query slots + key validity)
rather than a dense `[B, T, S]` boolean, so no implementation has to
materialise a quadratic mask.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

ATTENTION_IMPLS = ("xla", "cudnn", "chunked")
# With `attention_impl=None`, non-cuDNN paths switch from dense to chunked
# attention once a row's logits would exceed this many entries per head
# (2048 x 2048 fp32 = 16 MiB per head per row).
AUTO_CHUNKED_MIN_LOGITS = 2048 * 2048
# Masked logits use a large finite value (not -inf) so a row with no visible
# key yields finite values instead of NaN (also in gradients).
_MASK_VALUE = -1e30
# Query blocks of the dense causal path (`causal_block_attention`): more skip more of the
# masked logits but unroll into a longer program (the test suite sets 2 to compile faster).
def _query_blocks_from_env(name: str = "BAT_JAX_CAUSAL_QUERY_BLOCKS", default: str = "8") -> int:
  value = os.environ.get(name, default)
  if not value.isdigit() or int(value) < 1:
    raise ValueError(f"environment variable {name}={value!r} must be a positive integer")
  return int(value)


CAUSAL_QUERY_BLOCKS = _query_blocks_from_env()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
  """Key slot s is visible to query t of row b iff
  `key_valid[b, s] and s <= query_slots[b, t]`.

  query_slots: [B, T] int32 absolute slot of each query token.
  key_valid: [B, S] bool, keys that exist (written, not padding).
  aligned: static; True when query t sits at slot t over the same chunk
    (cache-free forward, S == T), i.e. plain causal masking.
  """

  query_slots: jax.Array
  key_valid: jax.Array
  aligned: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @classmethod
  def causal(cls, valid: jax.Array) -> AttentionMask:
    """Cache-free causal mask over one chunk; valid: [B, T] bool."""
    b, t = valid.shape
    slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return cls(query_slots=slots, key_valid=valid.astype(bool), aligned=True)

  @classmethod
  def for_cache(cls, query_slots: jax.Array, new_lengths: jax.Array, span: int
                ) -> AttentionMask:
    """Mask over the first `span` slots of a KV cache holding `new_lengths` [B] tokens."""
    key_valid = jnp.arange(span)[None, :] < new_lengths[:, None]
    return cls(query_slots=query_slots.astype(jnp.int32), key_valid=key_valid, aligned=False)

  def dense(self) -> jax.Array:
    """[B, T, S] bool visibility (quadratic; for the dense path and tests)."""
    s = self.key_valid.shape[1]
    key_slot = jnp.arange(s)[None, None, :]
    return (key_slot <= self.query_slots[..., None]) & self.key_valid[:, None, :]


def cudnn_max_head_dim(device: jax.Device | None = None) -> int:
  """Largest head_dim cuDNN flash attention accepts on `device` (default: the
  first device): 256 from Hopper (sm90), 128 on Ampere / Ada (sm8x), 0 on
  older GPUs, non-CUDA GPUs and other backends."""
  device = jax.devices()[0] if device is None else device
  if device.platform != "gpu":
    return 0
  try:
    major = int(str(device.compute_capability).split(".")[0])
  except (AttributeError, ValueError):  # ROCm reports gfx names: no cuDNN
    return 0
  return 256 if major >= 9 else 128 if major == 8 else 0


@functools.lru_cache(maxsize=None)
def _auto_cudnn(head_dim: int) -> bool:
  """Whether the automatic choice uses cuDNN for this head_dim (logged once)."""
  device = jax.devices()[0]
  limit = cudnn_max_head_dim(device)
  if head_dim <= limit:
    log.info("attention: cuDNN flash attention for head_dim %d on %s (cuDNN head_dim limit %d)",
             head_dim, device.device_kind, limit)
    return True
  log.warning("attention: cuDNN flash attention unavailable for head_dim %d on %s (cuDNN "
              "head_dim limit %d there; 256 needs Hopper / sm90 or newer): using XLA dense / "
              "chunked attention", head_dim, device.device_kind, limit)
  return False


def resolve_impl(impl: str | None, *, q_len: int, kv_len: int, mask: AttentionMask,
                 dtype, head_dim: int | None = None) -> str:
  """The implementation to run for one call.

  An explicit choice is honoured, except that `cudnn` cannot express a cache
  mask (per-row offsets), so cached calls fall back to the automatic choice
  between `xla` and `chunked`; an explicit `cudnn` that the GPU cannot run for
  `head_dim` is an error. `None`: cuDNN on GPU for half-precision cache-free
  chunks where the device's compute capability supports `head_dim` (see
  `cudnn_max_head_dim`), else chunked when the logits are large, else xla.
  """
  if impl is not None and impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl {impl!r} is not one of {ATTENTION_IMPLS} or None")
  if impl in ("xla", "chunked"):
    return impl
  on_gpu = jax.default_backend() == "gpu"
  if mask.aligned and impl == "cudnn":
    if on_gpu and head_dim is not None and head_dim > cudnn_max_head_dim():
      raise ValueError(
          f"attention_impl 'cudnn' does not support head_dim {head_dim} on "
          f"{jax.devices()[0].device_kind} (limit {cudnn_max_head_dim()}); use 'chunked' or None")
    return "cudnn"
  if (mask.aligned and impl is None and on_gpu and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
      and _auto_cudnn(head_dim or 0)):
    return "cudnn"
  return "chunked" if q_len * kv_len >= AUTO_CHUNKED_MIN_LOGITS else "xla"


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, *,
           impl: str | None = None, block_size: int = 512) -> jax.Array:
  """Scaled (1/sqrt(Dh)) causal GQA attention.

  Args:
    q: [B, T, H, Dh] queries (not yet scaled).
    k, v: [B, S, K, Dh] with H % K == 0 (query head h uses kv head h // (H/K)).
    mask: visibility of key slots to queries.
    impl: "xla" | "cudnn" | "chunked" | None (automatic, see `resolve_impl`).
    block_size: query / key block length of the chunked implementation.
  Returns:
    [B, T, H, Dh] in q's dtype. Rows with no visible key are finite (their
    value differs between implementations and must not be used).
  """
  scale = q.shape[-1] ** -0.5
  chosen = resolve_impl(impl, q_len=q.shape[1], kv_len=k.shape[1], mask=mask, dtype=q.dtype,
                        head_dim=q.shape[-1])
  if chosen == "chunked":
    return chunked_attention(q, k, v, mask, scale=scale, block_size=block_size)
  if chosen == "cudnn":
    # Right padding only: key validity becomes per-row lengths.
    lengths = jnp.sum(mask.key_valid, axis=1, dtype=jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        key_value_seq_lengths=lengths, implementation="cudnn")
  if mask.aligned:
    return causal_block_attention(q, k, v, mask.key_valid, scale=scale)
  return jax.nn.dot_product_attention(q, k, v, mask=mask.dense()[:, None], scale=scale,
                                      implementation="xla")


def attend_cached(q: jax.Array, key_t: jax.Array, value: jax.Array, mask: AttentionMask, *,
                  impl: str | None = None, block_size: int = 512) -> jax.Array:
  """`attend` over a decode cache in its own layout (`bat_jax.model.layers.KVCache`).

  Args:
    q: [B, T, H, Dh] queries (not yet scaled).
    key_t: [B, K, Dh, S]; value: [B, K, S, Dh] (the cache's first S slots).
    mask: visibility of the S slots to each query (`AttentionMask.for_cache`).
  Returns:
    [B, T, H, Dh] in q's dtype (softmax in fp32). Each kv head's query group is folded into
    the rows, so both matmuls are [B, K]-batched and read the cache without a transpose.
  """
  b, t, h, dh = q.shape
  kv_heads, s = key_t.shape[1], key_t.shape[-1]
  scale = dh ** -0.5
  if resolve_impl(impl, q_len=t, kv_len=s, mask=mask, dtype=q.dtype, head_dim=dh) == "chunked":
    # Long chunks over a long cache: bounded logits memory matters more than the transpose.
    return chunked_attention(q, key_t.transpose(0, 3, 1, 2), value.transpose(0, 2, 1, 3), mask,
                             scale=scale, block_size=block_size)
  groups = h // kv_heads
  q_rows = q.reshape(b, t, kv_heads, groups, dh).transpose(0, 2, 3, 1, 4)
  q_rows = q_rows.reshape(b, kv_heads, groups * t, dh)                        # row = (g, t)
  logits = jnp.einsum("bkqd,bkds->bkqs", q_rows, key_t,
                      preferred_element_type=jnp.float32) * scale
  visible = jnp.tile(mask.dense(), (1, groups, 1))[:, None]                   # [B, 1, GT, S]
  probs = jax.nn.softmax(jnp.where(visible, logits, _MASK_VALUE), axis=-1)
  out = jnp.einsum("bkqs,bksd->bkqd", probs.astype(value.dtype), value,
                   preferred_element_type=jnp.float32)
  return (out.reshape(b, kv_heads, groups, t, dh).transpose(0, 3, 1, 2, 4)
          .reshape(b, t, h, dh).astype(q.dtype))


def causal_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, *,
                           scale: float, num_blocks: int = CAUSAL_QUERY_BLOCKS) -> jax.Array:
  """Dense causal GQA attention over one cache-free chunk (query t at slot t), in query blocks.

  Query block i multiplies only the keys up to its own last row, so the logits above the
  diagonal (~half of `[T, S]`) are never computed, forward or backward. Each kv head's query
  group is folded into the rows, so a block is one `[B, K]`-batched matmul pair with no
  broadcast kv. Against `jax.nn.dot_product_attention(implementation="xla")` (fwd+bwd, CPU,
  8 heads / 2 kv heads of 32): B=8, T=256 105 -> 20 ms; B=2, T=1,024 383 -> 146 ms. The block
  count is a static unroll: more blocks skip more but compile longer.

  Args:
    q: [B, T, H, Dh]; k, v: [B, T, K, Dh]; key_valid: [B, T] bool.
    scale: logit scale.
    num_blocks: query blocks (at most; at least 16 rows each).
  Returns:
    [B, T, H, Dh] in q's dtype (softmax in fp32).
  """
  b, t, h, dh = q.shape
  kv_heads = k.shape[2]
  groups = h // kv_heads
  keys, values = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, Dh]
  block = max(-(-t // num_blocks), 16)
  outs = []
  for start in range(0, t, block):
    stop = min(start + block, t)
    n = stop - start
    q_blk = q[:, start:stop].reshape(b, n, kv_heads, groups, dh)
    q_blk = q_blk.transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, groups * n, dh)  # row = (g, t)
    logits = jnp.einsum("bkqd,bksd->bkqs", q_blk, keys[:, :, :stop],
                        preferred_element_type=jnp.float32) * scale
    rows = np.tile(np.arange(start, stop), groups)  # each row's query slot (static)
    visible = ((np.arange(stop)[None, :] <= rows[:, None])[None, None]
               & key_valid[:, None, None, :stop])                             # [B, 1, GN, S]
    probs = jax.nn.softmax(jnp.where(visible, logits, _MASK_VALUE), axis=-1)
    out = jnp.einsum("bkqs,bksd->bkqd", probs.astype(v.dtype), values[:, :, :stop],
                     preferred_element_type=jnp.float32)
    outs.append(out.reshape(b, kv_heads, groups, n, dh).transpose(0, 3, 1, 2, 4)
                .reshape(b, n, h, dh))
  return jnp.concatenate(outs, axis=1).astype(q.dtype)


def pad_axis1(x: jax.Array, size: int, value) -> jax.Array:
  """x padded with `value` along axis 1 up to `size`."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, size - x.shape[1])
  return jnp.pad(x, pad, constant_values=value)


def seq_blocks(x: jax.Array, block: int) -> jax.Array:
  """[B, N*block, ...] -> [N, B, block, ...] (scan-major)."""
  b, n = x.shape[0], x.shape[1] // block
  return jnp.moveaxis(x.reshape(b, n, block, *x.shape[2:]), 1, 0)


def _query_block(q_blk: jax.Array, slots: jax.Array, keys: tuple[jax.Array, ...], *,
                 scale: float) -> jax.Array:
  """One query block of `chunked_attention` against every key block (online softmax).

  q_blk: [B, bq, K, G, Dh]; slots: [B, bq]; keys: (k_blocks, v_blocks [Nk, B, bk, K, Dh],
  valid_blocks [Nk, B, bk], key_starts [Nk]). Returns fp32 [B, bq, K, G, Dh].
  """
  b, bq, kv_heads, groups, dh = q_blk.shape
  bk = keys[0].shape[2]
  newest = jnp.max(slots)

  def key_block(carry, xs):
    k_blk, v_blk, valid, start = xs

    def update(carry):
      m, l, acc = carry  # [B, K, G, bq], [B, K, G, bq], [B, K, G, bq, Dh]
      logits = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk,
                          preferred_element_type=jnp.float32) * scale
      key_slot = start + jnp.arange(bk, dtype=jnp.int32)
      visible = ((key_slot[None, None, :] <= slots[:, :, None])
                 & valid[:, None, :])[:, None, None]  # [B, 1, 1, bq, bk]
      logits = jnp.where(visible, logits, _MASK_VALUE)
      # The result is invariant to the running max: no gradient through it.
      m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(logits, axis=-1)))
      p = jnp.where(visible, jnp.exp(logits - m_new[..., None]), 0.0)
      correction = jnp.exp(m - m_new)
      l_new = l * correction + jnp.sum(p, axis=-1)
      pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v_blk.dtype), v_blk,
                      preferred_element_type=jnp.float32)
      return m_new, l_new, acc * correction[..., None] + pv

    needed = (start <= newest) & jnp.any(valid)
    return jax.lax.cond(needed, update, lambda c: c, carry), None

  init = (jnp.full((b, kv_heads, groups, bq), _MASK_VALUE, jnp.float32),
          jnp.zeros((b, kv_heads, groups, bq), jnp.float32),
          jnp.zeros((b, kv_heads, groups, bq, dh), jnp.float32))
  (_, l, acc), _ = jax.lax.scan(jax.checkpoint(key_block), init, keys)
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # no visible key -> 0
  return jnp.moveaxis(out, 3, 1)  # [B, bq, K, G, Dh]


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, *,
                      scale: float, block_size: int = 512) -> jax.Array:
  """Blockwise online-softmax attention (flash-attention recurrence) in JAX.

  Args, returns: as `attend`; softmax statistics and accumulators in fp32.
  Query blocks are scanned; for each, key blocks update a running max `m`,
  normaliser `l` and output accumulator. Key blocks with no visible key for
  the query block (above the causal diagonal, past the cache length) are
  skipped with `lax.cond`. Both scan bodies are rematerialised, so backward
  keeps only per-block carries, never the `[bq, bk]` probabilities.
  """
  if block_size < 1:
    raise ValueError(f"attention block_size must be positive, got {block_size}")
  b, t, h, dh = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  groups = h // kv_heads
  bq, bk = min(block_size, t), min(block_size, s)
  tp, sp = math.ceil(t / bq) * bq, math.ceil(s / bk) * bk
  # Padded queries see nothing (slot -1); padded keys are invalid.
  q_blocks = seq_blocks(pad_axis1(q, tp, 0).reshape(b, tp, kv_heads, groups, dh), bq)
  slot_blocks = seq_blocks(pad_axis1(mask.query_slots, tp, -1), bq)  # [Nq, B, bq]
  k_blocks = seq_blocks(pad_axis1(k, sp, 0), bk)  # [Nk, B, bk, K, Dh]
  v_blocks = seq_blocks(pad_axis1(v, sp, 0), bk)
  valid_blocks = seq_blocks(pad_axis1(mask.key_valid, sp, False), bk)  # [Nk, B, bk]
  key_starts = jnp.arange(sp // bk, dtype=jnp.int32) * bk
  keys = (k_blocks, v_blocks, valid_blocks, key_starts)

  def scan_body(_, xs):
    return None, _query_block(*xs, keys, scale=scale).astype(q.dtype)

  _, out = jax.lax.scan(jax.checkpoint(scan_body), None, (q_blocks, slot_blocks))
  out = jnp.moveaxis(out, 0, 1).reshape(b, tp, h, dh)  # [B, Tp, H, Dh]
  return out[:, :t]
