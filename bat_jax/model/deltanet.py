"""Gated DeltaNet (Qwen3.5 `linear_attention` layers) in Flax NNX.

The gated delta rule keeps a per-head state S [Dk, Dv] and, per token t:

    S <- exp(g_t) * S                       (decay)
    S <- S + k_t (beta_t * (v_t - k_t^T S))^T  (delta-rule write)
    o_t = S^T q_t

Two equivalent forms:
* `gated_delta_rule_recurrent`: a `lax.scan` over tokens (decode, reference).
* `gated_delta_rule_chunked`: a WY/UT-transform form that is parallel inside a
  chunk and scans only over chunks (training and prefill).

Both compute in fp32 whatever the input dtype and take / return the state, so
a prefill chunk can continue from a cache. Invalid (padding) tokens get
q = k = v = 0, g = 0 and beta = 0 (set with `where`, so even non-finite padding
activations cannot leak), which leaves the state exactly unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax.model.layers import Linear, logical_param, rms_normalize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaNetState:
  """Decode state of one DeltaNet layer.

  conv: [B, K-1, C] last K-1 conv inputs (C = 2 * key_dim + value_dim).
  recurrent: [B, Hv, Dk, Dv] fp32 delta-rule state.
  """

  conv: jax.Array
  recurrent: jax.Array


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum(x^2) + eps) over the last axis (FLA / HF convention)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_delta_rule_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                               beta: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Token-by-token gated delta rule.

  Args:
    q, k: [B, T, H, Dk] fp32 (normalised; q pre-scaled).
    v: [B, T, H, Dv] fp32.
    g: [B, T, H] log decay (<= 0). beta: [B, T, H] write strength.
    state: [B, H, Dk, Dv] initial state.
  Returns:
    (out [B, T, H, Dv] fp32, final state [B, H, Dk, Dv] fp32).
  """
  q, k, v, g, beta, state = (a.astype(jnp.float32) for a in (q, k, v, g, beta, state))

  def step(s, inputs):
    q_t, k_t, v_t, g_t, b_t = inputs  # [B, H, D*], [B, H]
    s = s * jnp.exp(g_t)[..., None, None]
    kv_mem = jnp.einsum("bhk,bhkv->bhv", k_t, s)
    delta = (v_t - kv_mem) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.einsum("bhk,bhkv->bhv", q_t, s)

  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
  state, out = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(out, 0, 1), state


def unit_lower_inverse(a: jax.Array) -> jax.Array:
  """(I + A)^-1 for strictly lower-triangular A [..., C, C], by block doubling.

  Starting from T = I (the inverse of the 1x1 diagonal blocks), each level
  merges neighbouring diagonal blocks of size s into blocks of size 2s:

      [[T11, 0], [A21, T22]]^-1 ... = [[T11, 0], [-T22 A21 T11, T22]],

  written over the full matrix as T <- T - T (A * M_s) T, where the static
  mask M_s keeps only the A21 blocks of level s. 2 ceil(log2 C) batched
  matmuls, like a Neumann series by repeated squaring, but every intermediate
  is an exact inverse of a principal sub-block (a product of delta-rule
  contractions, entries of order 1), so nothing cancels. The series
  sum_k (-A)^k forms powers of A whose entries grow like binom(C, k) for
  similar keys and slow decay, and cancels catastrophically (fla's
  `solve_tril` merges diagonal-block inverses the same way).
  """
  c = a.shape[-1]
  rows, cols = np.arange(c)[:, None], np.arange(c)[None, :]
  hi = jax.lax.Precision.HIGHEST
  inverse = jnp.broadcast_to(jnp.eye(c, dtype=a.dtype), a.shape)
  size = 1
  while size < c:
    lower_block = ((rows // size) % 2 == 1) & (rows // size == cols // size + 1)
    a_level = jnp.where(lower_block, a, 0.0)
    inverse = inverse - jnp.matmul(jnp.matmul(inverse, a_level, precision=hi), inverse,
                                   precision=hi)
    size *= 2
  return inverse


def _block_rows(i: int, block: int) -> slice:
  return slice(i * block, (i + 1) * block)


def _forward_substitution(a: jax.Array, rhs: jax.Array, diag_inverse: jax.Array,
                          block: int) -> jax.Array:
  """(I + A)^-1 rhs by block rows: X_i = T_ii (R_i - A_i,<i X_<i), T_ii = diag_inverse[i]."""
  hi = jax.lax.Precision.HIGHEST
  solved = []
  for i in range(diag_inverse.shape[-3]):
    r = rhs[..., _block_rows(i, block), :]
    if i:
      done = jnp.concatenate(solved, axis=-2)  # [..., i * block, D]
      r = r - jnp.matmul(a[..., _block_rows(i, block), :i * block], done, precision=hi)
    solved.append(jnp.matmul(diag_inverse[..., i, :, :], r, precision=hi))
  return jnp.concatenate(solved, axis=-2)


def _backward_substitution(a: jax.Array, rhs: jax.Array, diag_inverse: jax.Array,
                           block: int) -> jax.Array:
  """(I + A)^-T rhs by block rows from the last: Y_i = T_ii^T (R_i - (A_>i,i)^T Y_>i)."""
  hi = jax.lax.Precision.HIGHEST
  n = diag_inverse.shape[-3]
  solved = []  # block rows i+1 .. n-1, in order
  for i in reversed(range(n)):
    r = rhs[..., _block_rows(i, block), :]
    if solved:
      done = jnp.concatenate(solved, axis=-2)  # [..., (n - 1 - i) * block, D]
      below = a[..., (i + 1) * block:, _block_rows(i, block)]
      r = r - jnp.einsum("...ji,...jd->...id", below, done, precision=hi)
    solved.insert(0, jnp.einsum("...ji,...jd->...id", diag_inverse[..., i, :, :], r,
                                precision=hi))
  return jnp.concatenate(solved, axis=-2)


def _diag_inverse(a: jax.Array, block: int) -> jax.Array:
  """Inverses of the [block, block] diagonal blocks of I + A: [..., C / block, block, block]."""
  n = a.shape[-1] // block
  return unit_lower_inverse(
      jnp.stack([a[..., _block_rows(i, block), _block_rows(i, block)] for i in range(n)], -3))


def unit_lower_solve(a: jax.Array, rhs: jax.Array, block: int = 16) -> jax.Array:
  """(I + A)^-1 rhs for strictly lower-triangular A [..., C, C] and rhs [..., C, D].

  Blocked forward substitution: the [block, block] diagonal blocks are inverted with
  `unit_lower_inverse` (batched together), then block row i solves

      X_i = T_ii (R_i - A_i,<i X_<i),

  one matmul against the rows already solved and one with the block inverse. Only the
  diagonal blocks are ever inverted, so for C = 64 this is ~12x fewer flops than inverting the
  whole chunk (2 log2 C full [C, C] matmuls) and it never forms (I + A)^-1; forward
  substitution is as stable as the triangular solve it is.

  The VJP is the triangular solve's own (not autodiff through the substitution and the
  block inverses): with X = (I + A)^-1 R, dR = (I + A)^-T dX by the same blocked
  substitution run from the last block row with the forward's block inverses, and
  dA = -dR X^T on the strict lower triangle.
  """
  c = a.shape[-1]
  block = min(block, c)
  if c % block:
    raise ValueError(f"chunk size {c} is not a multiple of the solve block {block}")
  return _solve(a, rhs, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _solve(a: jax.Array, rhs: jax.Array, block: int) -> jax.Array:
  return _forward_substitution(a, rhs, _diag_inverse(a, block), block)


def _solve_fwd(a, rhs, block):
  diag_inverse = _diag_inverse(a, block)
  x = _forward_substitution(a, rhs, diag_inverse, block)
  return x, (a, diag_inverse, x)


def _solve_bwd(block, saved, dx):
  a, diag_inverse, x = saved
  d_rhs = _backward_substitution(a, dx, diag_inverse, block)
  c = a.shape[-1]
  strict_lower = np.tril(np.ones((c, c), bool), -1)
  d_a = -jnp.einsum("...id,...jd->...ij", d_rhs, x, precision=jax.lax.Precision.HIGHEST)
  return jnp.where(strict_lower, d_a, 0.0), d_rhs


_solve.defvjp(_solve_fwd, _solve_bwd)


def _chunk_group(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                 beta: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Gated delta rule over a group of G full chunks of C tokens.

  Chunk-major layout: the scan over the group's chunks takes its inputs and gives its output
  along the leading axis as they are, with no transposes in and out of the loop (nor their
  transposes in the backward).

  Args:
    state: [B, H, Dk, Dv] fp32 state before the group.
    q, k: [G, B, H, C, Dk]; v: [G, B, H, C, Dv]; g, beta: [G, B, H, C] (fp32).
  Returns:
    (state after the group, out [G, B, H, C, Dv]).
  """
  c = q.shape[-2]
  g_cum = jnp.cumsum(g, axis=-1)  # [G, B, H, C] log decay from chunk start
  incl_lower = jnp.tril(jnp.ones((c, c), dtype=bool))
  strict_lower = jnp.tril(jnp.ones((c, c), dtype=bool), -1)
  diff = g_cum[..., :, None] - g_cum[..., None, :]  # [.., i, j] decay from j to i
  decay = jnp.where(incl_lower, jnp.exp(jnp.where(incl_lower, diff, 0.0)), 0.0)

  k_beta = k * beta[..., None]
  v_beta = v * beta[..., None]
  hi = jax.lax.Precision.HIGHEST
  mm = lambda eq, x, y: jnp.einsum(eq, x, y, precision=hi)
  # (I + A) with A strictly lower: the UT system of the delta rule in a chunk.
  a_mat = jnp.where(strict_lower, mm("...ik,...jk->...ij", k_beta, k) * decay, 0.0)
  # One solve for both right-hand sides: u (new values) and w (reads of the old state).
  dv = v.shape[-1]
  uw = unit_lower_solve(a_mat, jnp.concatenate([v_beta, k_beta * jnp.exp(g_cum)[..., None]], -1))
  u, w = uw[..., :dv], uw[..., dv:]
  intra = mm("...ik,...jk->...ij", q, k) * decay  # causal within the chunk
  q_decayed = q * jnp.exp(g_cum)[..., None]
  k_to_end = k * jnp.exp(g_cum[..., -1:] - g_cum)[..., None]
  chunk_decay = jnp.exp(g_cum[..., -1])  # [G, B, H]

  def step(s, inputs):
    u_i, w_i, q_i, k_i, intra_i, decay_i = inputs
    v_new = u_i - mm("bhck,bhkv->bhcv", w_i, s)
    out = mm("bhck,bhkv->bhcv", q_i, s) + mm("bhcd,bhdv->bhcv", intra_i, v_new)
    s = s * decay_i[..., None, None] + mm("bhck,bhcv->bhkv", k_i, v_new)
    return s, out

  return jax.lax.scan(step, state, (u, w, q_decayed, k_to_end, intra, chunk_decay))


def gated_delta_rule_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                             beta: jax.Array, state: jax.Array, chunk_size: int = 64,
                             chunks_per_group: int = 16) -> tuple[jax.Array, jax.Array]:
  """Chunk-parallel gated delta rule (same contract as the recurrent form).

  Inside a chunk of C tokens the sequential writes are condensed with the
  inverse of a unit lower-triangular system (the UT transform); only the
  chunk-to-chunk state hand-off is a scan, so there is no loop over tokens.
  Decay factors are only ever exp of non-positive numbers (differences are
  masked to the causal triangle before exp), and the UT system is solved by the
  stable blocked forward substitution of `unit_lower_solve`.

  Memory: chunks are processed in groups of up to `chunks_per_group` by a
  rematerialised scan, so the backward keeps one [H, Dk, Dv] state per group
  and recomputes a group's [C, C] matrices, solves and per-chunk states while
  differentiating it; the whole-sequence intermediates (several fp32
  [H, T, C] and [H, T, D] arrays per layer) are never live at once. A sequence
  of one group (T <= C * chunks_per_group) is not rematerialised here: that
  would only rerun the group's forward, the layer's remat policy already decides
  what a layer keeps for its backward.
  """
  q, k, v, g, beta, state = (a.astype(jnp.float32) for a in (q, k, v, g, beta, state))
  b, t, h, dk = k.shape
  dv = v.shape[-1]
  # Always full chunks (T padded up): a token's arithmetic does not depend on how many tokens
  # follow it, so right padding leaves real-token outputs bit-for-bit comparable. Whole groups
  # too: fewest groups of at most `chunks_per_group`, sized evenly (< 1 padded chunk per group).
  c = chunk_size
  n = -(-t // c)
  num_groups = -(-n // chunks_per_group)
  group = -(-n // num_groups)
  pad = num_groups * group * c - t
  if pad:  # g = beta = 0 on padding: no decay, no write.
    q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
    g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))

  def groups(a):  # [B, T, H, ...] -> [NG, G, B, H, C, ...]: one transpose
    a = a.reshape((b, num_groups, group, c) + a.shape[2:])
    return jnp.moveaxis(a, (1, 2, 0, 4, 3), (0, 1, 2, 3, 4))

  body = lambda s, xs: _chunk_group(s, *xs)
  if num_groups > 1:
    body = jax.checkpoint(body)
  state, out = jax.lax.scan(body, state, tuple(groups(a) for a in (q, k, v, g, beta)))
  # [NG, G, B, H, C, Dv] -> [B, NG, G, C, H, Dv] -> [B, T, H, Dv]: one transpose.
  out = jnp.moveaxis(out, (0, 1, 2, 3, 4), (1, 2, 0, 4, 3))
  return out.reshape(b, num_groups * group * c, h, dv)[:, :t], state


def causal_conv(x: jax.Array, weight: jax.Array, history: jax.Array) -> jax.Array:
  """Depthwise causal conv + SiLU.

  Args:
    x: [B, T, C] new inputs.
    weight: [C, K] per-channel taps (tap K-1 multiplies the current token).
    history: [B, K-1, C] the K-1 inputs before x (zeros at sequence start).
  Returns:
    [B, T, C].
  """
  t, kernel = x.shape[1], weight.shape[1]
  ext = jnp.concatenate([history.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
  w = weight.astype(x.dtype)
  out = sum(ext[:, j:j + t, :] * w[:, j] for j in range(kernel))
  return jax.nn.silu(out)


def next_conv_history(x: jax.Array, history: jax.Array, num_valid: jax.Array) -> jax.Array:
  """Last K-1 conv inputs after consuming the first `num_valid` tokens of x.

  Args:
    x: [B, T, C]; history: [B, K-1, C]; num_valid: [B] valid (prefix) lengths.
  Returns:
    [B, K-1, C].
  """
  width = history.shape[1]
  ext = jnp.concatenate([history, x.astype(history.dtype)], axis=1)
  take = lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, width, axis=0)
  return jax.vmap(take)(ext, num_valid.astype(jnp.int32))


class GatedRMSNorm(nnx.Module):
  """RMSNorm(x) * w * silu(gate), w initialised to 1 (not zero-centred)."""

  def __init__(self, dim: int, *, eps: float, param_dtype):
    self.eps = eps
    self.weight = logical_param(jnp.ones((dim,), param_dtype), ("norm",))

  def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
    normed = rms_normalize(x, self.eps)
    y = self.weight[...].astype(x.dtype) * normed.astype(x.dtype)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
  """Qwen3.5 linear-attention token mixer (HF `Qwen3_5GatedDeltaNet`)."""

  def __init__(self, *, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
               head_v_dim: int, conv_kernel: int, eps: float, chunk_size: int, dtype,
               param_dtype, rngs: nnx.Rngs):
    self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
    self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
    self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    self.conv_dim = 2 * self.key_dim + self.value_dim
    self.conv_kernel = conv_kernel
    self.chunk_size = chunk_size
    self.dtype = dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.in_proj_qkv = Linear(hidden_size, self.conv_dim, axes=("embed", "heads"), **kw)
    self.in_proj_z = Linear(hidden_size, self.value_dim, axes=("embed", "heads"), **kw)
    self.in_proj_b = Linear(hidden_size, num_v_heads, axes=("embed", "heads"), **kw)
    self.in_proj_a = Linear(hidden_size, num_v_heads, axes=("embed", "heads"), **kw)
    conv = jax.random.normal(rngs.params(), (self.conv_dim, conv_kernel)) / conv_kernel ** 0.5
    self.conv_weight = logical_param(conv.astype(param_dtype), ("heads", None))
    self.dt_bias = logical_param(jnp.ones((num_v_heads,), param_dtype), ("heads",))
    a_init = jax.random.uniform(rngs.params(), (num_v_heads,), minval=0.01, maxval=16.0)
    self.A_log = logical_param(jnp.log(a_init).astype(param_dtype), ("heads",))
    self.norm = GatedRMSNorm(head_v_dim, eps=eps, param_dtype=param_dtype)
    self.out_proj = Linear(self.value_dim, hidden_size, axes=("heads", "embed"), **kw)

  def init_state(self, batch_size: int, dtype) -> DeltaNetState:
    return DeltaNetState(
        conv=jnp.zeros((batch_size, self.conv_kernel - 1, self.conv_dim), dtype),
        recurrent=jnp.zeros((batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim),
                            jnp.float32))

  def __call__(self, x: jax.Array, *, valid: jax.Array, state: DeltaNetState | None = None
               ) -> tuple[jax.Array, DeltaNetState | None]:
    """Mixes tokens of x.

    Args:
      x: [B, T, D].
      valid: [B, T] bool; valid tokens must form a prefix of each row (right
        padding). Invalid tokens leave conv and recurrent state unchanged.
      state: decode state to continue from, or None (fresh sequence).
    Returns:
      ([B, T, D], new state or None when `state` is None).
    """
    b, t, _ = x.shape
    valid = valid.astype(bool)
    x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))
    qkv_in = self.in_proj_qkv(x)  # [B, T, C]
    history = (state.conv if state is not None else
               jnp.zeros((b, self.conv_kernel - 1, self.conv_dim), qkv_in.dtype))
    qkv = causal_conv(qkv_in, self.conv_weight[...], history)
    q, k, v = jnp.split(qkv, [self.key_dim, 2 * self.key_dim], axis=-1)
    q = q.reshape(b, t, self.num_k_heads, self.head_k_dim).astype(jnp.float32)
    k = k.reshape(b, t, self.num_k_heads, self.head_k_dim).astype(jnp.float32)
    v = v.reshape(b, t, self.num_v_heads, self.head_v_dim).astype(jnp.float32)
    # Grouped value heads: key head i serves value heads [i*r, (i+1)*r).
    rep = self.num_v_heads // self.num_k_heads
    q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
    # Padding is made inert with `where` (never 0 * x, which keeps a NaN).
    keep = valid[:, :, None, None]  # [B, T, 1, 1]
    q = jnp.where(keep, l2_normalize(q) * self.head_k_dim ** -0.5, 0.0)
    k = jnp.where(keep, l2_normalize(k), 0.0)
    v = jnp.where(keep, v, 0.0)

    beta = jnp.where(valid[..., None], jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32)), 0.0)
    a = self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)
    g = jnp.where(valid[..., None], g, 0.0)  # [B, T, Hv] log decay

    s0 = (state.recurrent if state is not None else
          jnp.zeros((b, self.num_v_heads, self.head_k_dim, self.head_v_dim), jnp.float32))
    if state is not None and t == 1:
      core, s1 = gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    else:
      core, s1 = gated_delta_rule_chunked(q, k, v, g, beta, s0, self.chunk_size)

    z = self.in_proj_z(x).reshape(b, t, self.num_v_heads, self.head_v_dim)
    out = self.norm(core.astype(self.dtype), z).reshape(b, t, self.value_dim)
    out = self.out_proj(out)
    new_state = None
    if state is not None:
      num_valid = jnp.sum(valid, axis=1)
      new_state = DeltaNetState(conv=next_conv_history(qkv_in, state.conv, num_valid),
                                recurrent=s1)
    return out, new_state
