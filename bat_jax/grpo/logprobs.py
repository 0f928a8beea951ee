"""Taken-token logprobs without materialising the `[B, T, V]` float32 logits.

The final hidden states are cut into sequence chunks and a `lax.scan` computes, per chunk, the
`[B, C, V]` logits, their logsumexp and the taken token's logit. By default the backward
(`_recomputing_head`) recomputes each chunk's logits from its `[B, C, D]` hidden chunk, so peak
memory is O(B * C * V) instead of O(B * T * V) (Qwen3.5's V is ~248k). For
small vocabularies `save_probs` keeps the whole `[B, T, V]` softmax (no chunks) and a hand-written
backward (`_saved_probs_head`) skips that matmul. The recomputing backward runs per device and
reduces the unembedding's gradient once, after the chunk loop (see `_recomputing_head`); its
local fp32 `[D, V]` accumulator costs 1.7 GiB more temp per device in the bat9b GRPO step's plan
(58.9 vs 57.2 GiB, measured before guarded_adamw) and saves 2 all-gathers and 1 all-reduce of `[D, V]` per chunk."""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from bat_jax import sharding

Array = jax.Array


def _check_shapes(hidden: Array, kernel: Array, targets: Array, chunk_size: int) -> None:
  if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
    raise ValueError(f"hidden {hidden.shape} must be [B, T, D] and targets {targets.shape} [B, T]")
  if kernel.ndim != 2 or kernel.shape[0] != hidden.shape[-1]:
    raise ValueError(f"kernel {kernel.shape} must be [D={hidden.shape[-1]}, V]")
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be > 0, got {chunk_size}")


def _chunk_logits(h: Array, kernel: Array, temperature: float) -> Array:
  """`[B, C, V]` fp32 logits / temperature of one hidden chunk `[B, C, D]`."""
  # Rank-2 matmul (see `Linear`): [B*C, D] @ [D, V], batch-major so batch sharding carries.
  logits = jnp.dot(h.reshape(-1, h.shape[-1]), kernel, preferred_element_type=jnp.float32)
  return logits.reshape(*h.shape[:-1], kernel.shape[-1]) / temperature


def _saved_probs_head(temperature: float, with_entropy: bool):
  """`(hidden [B, T, D], targets [B, T], kernel [D, V]) -> (logp, entropy)` (each `[B, T]`
  fp32), with a hand-written VJP that keeps the softmax.

  The gradient of a taken-token logprob w.r.t. the logits is `(onehot - softmax) / temperature`,
  so with the `[B*T, V]` softmax saved (O(B * T * V) memory: small vocabularies only) the
  backward skips the logits matmul and differentiates no one-hot or gather. Since the softmax
  is kept whole anyway, the sequence is not chunked: one matmul each way (a scan over chunks
  stacked its `[N, B, C, V]` output in a buffer whose memset and slice copies cost as much as
  the softmax). The entropy carries no gradient.
  """

  def forward(hidden, targets, kernel):
    h = hidden.reshape(-1, hidden.shape[-1])                                      # [B*T, D]
    logits = jnp.dot(h, kernel, preferred_element_type=jnp.float32) / temperature  # [B*T, V]
    lse = jax.nn.logsumexp(logits, axis=-1)
    taken = jnp.take_along_axis(logits, targets.reshape(-1, 1), axis=-1)[:, 0]
    probs = jnp.exp(logits - lse[:, None])
    ent = (lse - (probs * logits).sum(-1)) if with_entropy else jnp.zeros_like(lse)
    shape = targets.shape
    return ((taken - lse).reshape(shape), ent.reshape(shape)), (h, targets, kernel, probs)

  def backward(residuals, cotangents):
    h, targets, kernel, probs = residuals
    d_logp = cotangents[0].reshape(-1, 1)  # the entropy's cotangent is dropped (no gradient)
    hit = jax.lax.broadcasted_iota(jnp.int32, probs.shape, 1) == targets.reshape(-1, 1)
    d_logits = ((hit.astype(jnp.float32) - probs) * (d_logp / temperature)).astype(kernel.dtype)
    d_h = jnp.dot(d_logits, kernel.T, preferred_element_type=jnp.float32)         # [B*T, D]
    d_kernel = jnp.dot(h.T, d_logits, preferred_element_type=jnp.float32)         # [D, V]
    return (d_h.reshape(*targets.shape, -1).astype(h.dtype), None,
            d_kernel.astype(kernel.dtype))

  head = jax.custom_vjp(lambda h, t, k: forward(h, t, k)[0])
  head.defvjp(forward, backward)
  return head


def _chunk_stats(h: Array, t: Array, kernel: Array, temperature: float, with_entropy: bool):
  """`(logits [B, C, V], logp [B, C], entropy [B, C], lse [B, C])` of one hidden chunk."""
  logits = _chunk_logits(h, kernel, temperature)
  lse = jax.nn.logsumexp(logits, axis=-1)                              # [B, C]
  # A one-hot select, not take_along_axis (exact: one logit plus zeros; a gather's transpose
  # is a scatter, serial on CPU).
  hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t[..., None]
  taken = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)                # [B, C]
  ent = jnp.zeros_like(lse)
  if with_entropy:
    ent = lse - (jax.nn.softmax(logits, axis=-1) * logits).sum(-1)
  return logits, taken - lse, ent, lse


def _split_axes(spec, mesh) -> tuple[str, ...]:
  """The mesh axes of size > 1 in one PartitionSpec entry."""
  axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
  return tuple(a for a in axes if mesh.shape[a] > 1)


def _local_backward(h_chunks: Array, t_chunks: Array, kernel: Array, lse: Array, d_logp: Array,
                    temperature: float, vocab_axes: tuple[str, ...],
                    varying_axes: tuple[str, ...] = ()) -> tuple[Array, Array]:
  """One device's backward of `_recomputing_head` over its rows: `(d_hidden [N, B, C, D],
  d_kernel [1, D, V])`, the kernel's gradient summed over this device's rows only, in fp32.
  `kernel` is `[D, V]` (this device's vocab slice when `vocab_axes` shard it); `lse` is the
  forward's global logsumexp, so a vocab slice's softmax needs no collective. `varying_axes`: the
  mesh axes the inputs are split over (the accumulator differs along them)."""
  offset = 0
  if vocab_axes:
    offset = jax.lax.axis_index(vocab_axes) * kernel.shape[1]

  def one_chunk(d_kernel, xs):
    h, t, lse_c, d_c = xs                                                 # [B, C, ...]
    logits = _chunk_logits(h, kernel, temperature)                        # [B, C, V]
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) + offset == t[..., None]
    probs = jnp.exp(logits - lse_c[..., None])
    d_logits = ((hit.astype(jnp.float32) - probs) * (d_c / temperature)[..., None]
                ).astype(kernel.dtype)
    flat = d_logits.reshape(-1, d_logits.shape[-1])                       # [B*C, V]
    d_h = jnp.dot(flat, kernel.T, preferred_element_type=jnp.float32)    # [B*C, D]
    if vocab_axes:  # each vocab slice contributes a partial sum
      d_h = jax.lax.psum(d_h, vocab_axes)
    d_kernel += jnp.dot(h.reshape(-1, h.shape[-1]).T, flat, preferred_element_type=jnp.float32)
    return d_kernel, d_h.reshape(h.shape).astype(h.dtype)

  zeros = jnp.zeros(kernel.shape, jnp.float32)
  if varying_axes:
    zeros = jax.lax.pcast(zeros, varying_axes, to="varying")
  d_kernel, d_h = jax.lax.scan(one_chunk, zeros, (h_chunks, t_chunks, lse, d_logp))
  return d_h, d_kernel[None]


def _recomputing_head(temperature: float, with_entropy: bool):
  """Same signature as `_saved_probs_head` over `[N, B, C, ...]` chunks: the backward recomputes
  each chunk's logits (memory O(B * C * V) at any length: the 9B shapes).

  Collectives stay out of the chunk loop. The unembedding is gathered over its FSDP shards once,
  before the loop (not once per chunk each way), and the backward runs per device
  (`jax.shard_map`): each device accumulates its rows' `[D, V]` gradient locally in fp32 and the
  devices' sums are reduced once, after the loop. (Differentiating through a scan all-reduces
  the gradient at every chunk, and under automatic partitioning XLA moves even an explicit
  per-shard accumulator's reduction back into the loop; tests/grpo/test_logprobs.py counts the
  collectives in the compiled HLO.)
  """

  def forward(h_chunks, t_chunks, kernel):
    kernel = sharding.constrain(kernel, (None, "vocab"))  # gathered once over "embed"'s shards

    def one_chunk(_, xs):
      _, logp, ent, lse = _chunk_stats(*xs, kernel, temperature, with_entropy)
      return None, (logp, ent, lse)

    _, (logp, ent, lse) = jax.lax.scan(one_chunk, None, (h_chunks, t_chunks))
    return (logp, ent), (h_chunks, t_chunks, kernel, lse)

  def backward(residuals, cotangents):
    h_chunks, t_chunks, kernel, lse = residuals
    d_logp = cotangents[0]  # [N, B, C]; the entropy's cotangent is dropped (no gradient)
    active = sharding.active_mesh()
    if active is None:
      d_h, d_kernel = _local_backward(h_chunks, t_chunks, kernel, lse, d_logp, temperature,
                                      vocab_axes=())
      return d_h, None, d_kernel[0].astype(kernel.dtype)
    mesh, rules = active
    spec = lambda name, size: _split_axes(
        sharding.logical_to_spec((name,), rules, shape=(size,), mesh=mesh)[0], mesh) or None
    batch, vocab = spec("batch", h_chunks.shape[1]), spec("vocab", kernel.shape[1])
    chunks = P(None, batch)
    local = jax.shard_map(
        functools.partial(_local_backward, temperature=temperature, vocab_axes=vocab or (),
                          varying_axes=(*(batch or ()), *(vocab or ()))),
        mesh=mesh, in_specs=(chunks, chunks, P(None, vocab), chunks, chunks),
        out_specs=(chunks, P(batch, None, vocab)))
    d_h, d_kernel = local(h_chunks, t_chunks, kernel, lse, d_logp)   # d_kernel [S, D, V]
    d_kernel = sharding.constrain(d_kernel.sum(0), ("embed", "vocab"))  # the one reduction
    return d_h, None, d_kernel.astype(kernel.dtype)

  head = jax.custom_vjp(lambda h, t, k: forward(h, t, k)[0])
  head.defvjp(forward, backward)
  return head


def chunked_logprobs(hidden: Array, kernel: Array, targets: Array, *, chunk_size: int = 512,
                     temperature: float = 1.0, with_entropy: bool = False,
                     save_probs: bool = False) -> tuple[Array, Optional[Array]]:
  """Logprob of `targets` under `softmax(hidden @ kernel / temperature)`, chunked over T.

  Args:
    hidden: `[B, T, D]` final (normed) hidden states; row t predicts `targets[:, t]`.
    kernel: `[D, V]` unembedding matrix; cast to hidden's (compute) dtype once, on its shards,
      so a bf16 model gathers and multiplies a bf16 table (fp32 accumulation) even when the
      master weights are fp32.
    targets: `[B, T]` int token ids.
    chunk_size: sequence positions per chunk (T is padded up to a multiple); unused with
      `save_probs`.
    temperature: sampling temperature the rollouts used (logits are divided by it).
    with_entropy: also return the per-token entropy (no gradient flows through it).
    save_probs: keep the softmax for the backward instead of recomputing the logits matmul
      (`B * T * V * 4` bytes, not chunked; see `_saved_probs_head`).

  Returns:
    `(logp [B, T] float32, entropy [B, T] float32 or None)`.
  """
  _check_shapes(hidden, kernel, targets, chunk_size)
  batch, length, dim = hidden.shape
  if kernel.dtype != hidden.dtype:
    kernel = sharding.constrain(kernel.astype(hidden.dtype), ("embed", "vocab"))
  if save_probs:  # the whole softmax is kept anyway: no chunks (see `_saved_probs_head`)
    logp, ent = _saved_probs_head(temperature, with_entropy)(hidden, targets.astype(jnp.int32),
                                                             kernel)
    return logp, (jax.lax.stop_gradient(ent) if with_entropy else None)
  chunk = min(chunk_size, length)
  n_chunks = -(-length // chunk)
  pad = n_chunks * chunk - length
  hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(targets, ((0, 0), (0, pad)))
  # [n, B, C, ...]: scan over the leading chunk axis.
  h_chunks = hidden.reshape(batch, n_chunks, chunk, dim).swapaxes(0, 1)
  t_chunks = targets.reshape(batch, n_chunks, chunk).swapaxes(0, 1)
  h_chunks = sharding.constrain(h_chunks, (None, *sharding.ACTIVATION_AXES))
  logp, ent = _recomputing_head(temperature, with_entropy)(h_chunks, t_chunks.astype(jnp.int32),
                                                           kernel)
  logp = logp.swapaxes(0, 1).reshape(batch, n_chunks * chunk)[:, :length]
  ent = jax.lax.stop_gradient(ent).swapaxes(0, 1).reshape(batch, n_chunks * chunk)[:, :length]
  return logp, (ent if with_entropy else None)


def shift_to_positions(values: Array) -> Array:
  """`[B, T-1]` per-prediction values -> `[B, T]` aligned with the token they score (col 0 = 0)."""
  return jnp.pad(values, ((0, 0), (1, 0)))


def _final_hidden(model, input_ids: Array, valid: Array, positions: Optional[Array],
                  remat_policy: Optional[Callable[..., bool]]) -> Array:
  """`[B, T, D]` final hidden states (the training forward, rematerialised by `remat_policy`)."""
  kw = {} if remat_policy is None else {"remat_policy": remat_policy}
  return model.hidden_states(input_ids, positions=positions, valid=valid, **kw)


def taken_token_logprobs(model, input_ids: Array, *, valid: Array,
                         positions: Optional[Array] = None, chunk_size: int = 512,
                         temperature: float = 1.0, with_entropy: bool = False,
                         save_probs: bool = False, remat_policy: Optional[Callable[..., bool]] = None
                         ) -> tuple[Array, Optional[Array]]:
  """Per-position logprob of each token given its prefix, through `model.hidden_states`.

  Args:
    model: a decoder exposing `hidden_states(input_ids, *, positions, valid)` -> `[B, T, D]` and
      `unembed_kernel()` -> `[D, V]`.
    input_ids: `[B, T]` int32 tokens (prompt + response, right padded).
    valid: `[B, T]` bool, True on real tokens; each row's real tokens must be a prefix (right
      padding). Required: unmasked padding would enter the DeltaNet state and attention as
      tokens. Padding never influences a real position, and its outputs are exactly 0.
    positions: optional `[B, T]` positions.
    chunk_size, temperature, with_entropy, save_probs: see `chunked_logprobs`.
    remat_policy: per-layer rematerialisation policy for the model's forward (training).

  Returns:
    `(logp [B, T], entropy [B, T] or None)` with
    `logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])` where `valid[:, t]`, else 0;
    column 0 (no prefix) is 0, so the loss mask must be 0 there.
  """
  if valid is None or valid.shape != input_ids.shape:
    raise ValueError(f"valid {None if valid is None else valid.shape} must be a [B, T] mask "
                     f"shaped like input_ids {input_ids.shape}")
  valid = valid.astype(bool)
  hidden = _final_hidden(model, input_ids, valid, positions, remat_policy)
  logp, ent = chunked_logprobs(hidden[:, :-1], model.unembed_kernel(), input_ids[:, 1:],
                               chunk_size=chunk_size, temperature=temperature,
                               with_entropy=with_entropy, save_probs=save_probs)
  # `where`, not a product: a non-finite value at a pad position must not survive as 0 * NaN.
  scored = valid[:, 1:]
  logp = shift_to_positions(jnp.where(scored, logp, 0.0))
  if ent is not None:
    ent = shift_to_positions(jnp.where(scored, ent, 0.0))
  return logp, ent


def selected_token_logprobs(model, input_ids: Array, *, valid: Array, select: Array,
                            per_row: int, positions: Optional[Array] = None,
                            chunk_size: int = 512, save_probs: bool = False,
                            remat_policy: Optional[Callable[..., bool]] = None
                            ) -> tuple[Array, Array, Array]:
  """Logprobs of the `select`ed tokens only: the decoder runs over every token, the
  unembedding and its softmax only over each row's first `per_row` selected positions.

  A loss on a few tokens per row (an SFT row's target action: ~70 of ~600 tokens) otherwise pays
  the `[D, V]` head and a V-wide softmax at every position; here it pays them at `per_row`
  positions per row (`experiments/perf/sft_step.py`). Rows keep their batch axis, so batch
  sharding carries through the gather.

  Args:
    model, input_ids, valid, positions, chunk_size, save_probs, remat_policy: as in
      `taken_token_logprobs`.
    select: `[B, T]` bool, the positions whose token's logprob is wanted (never column 0).
    per_row: static bound on selected positions per row (`R`).

  Returns:
    `(logp [B, R], live [B, R] bool, overflow [])`: `logp[b, r]` is the logprob of row b's r-th
    selected token where `live`, else 0; `overflow` counts selected positions beyond `per_row`
    (dropped: a caller must treat > 0 as an error).
  """
  if select.shape != input_ids.shape or per_row < 1:
    raise ValueError(f"select {select.shape} must be shaped like input_ids {input_ids.shape} "
                     f"and per_row ({per_row}) >= 1")
  valid = valid.astype(bool)
  hidden = _final_hidden(model, input_ids, valid, positions, remat_policy)
  # Row t of `hidden` predicts token t + 1: select on the predicted tokens, gather predictors.
  chosen = (select.astype(bool) & valid)[:, 1:]                                 # [B, T-1]
  index = jax.vmap(lambda m: jnp.nonzero(m, size=per_row, fill_value=0)[0])(chosen)  # [B, R]
  count = chosen.sum(axis=1)                                                     # [B]
  live = jnp.arange(per_row)[None, :] < count[:, None]                           # [B, R]
  h_sel = jnp.take_along_axis(hidden[:, :-1], index[..., None], axis=1)           # [B, R, D]
  t_sel = jnp.take_along_axis(input_ids[:, 1:], index, axis=1)                   # [B, R]
  logp, _ = chunked_logprobs(h_sel, model.unembed_kernel(), t_sel, chunk_size=chunk_size,
                             save_probs=save_probs)
  overflow = jnp.maximum(count - per_row, 0).sum()
  return jnp.where(live, logp, 0.0), live, overflow
