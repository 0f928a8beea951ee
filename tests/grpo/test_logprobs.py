"""Chunked taken-token logprobs against the full `[B, T, V]` log-softmax."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bat_jax.grpo import chunked_logprobs, taken_token_logprobs
from policy_fixtures import grpo_batch, tiny_model


def test_taken_token_logprobs_match_full_log_softmax():
  model = tiny_model()
  ids = jnp.asarray(grpo_batch(0, batch=3, length=11)["input_ids"])
  full = jax.nn.log_softmax(jax.jit(lambda x: model(x))(ids) / 0.7, axis=-1)  # [B, T, V]
  want = jnp.take_along_axis(full[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
  want_ent = -(jnp.exp(full) * full).sum(-1)[:, :-1]
  # 10 predictions: an uneven split (padded last chunk) and a single chunk.
  for chunk in (4, 64):
    logp, ent = jax.jit(lambda x: taken_token_logprobs(model, x, valid=jnp.ones_like(x, bool),
                                                       chunk_size=chunk, temperature=0.7,
                                                       with_entropy=True))(ids)
    assert logp.shape == ids.shape and np.all(np.asarray(logp[:, 0]) == 0.0)
    np.testing.assert_allclose(logp[:, 1:], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent[:, 1:], want_ent, rtol=1e-5, atol=1e-5)


def test_valid_is_required_and_shaped_like_input_ids():
  model, ids = tiny_model(), jnp.zeros((2, 6), jnp.int32)
  with pytest.raises(TypeError, match="valid"):
    taken_token_logprobs(model, ids)  # pylint: disable=missing-kwoa
  with pytest.raises(ValueError, match=r"valid \(2, 5\) must be a \[B, T\] mask"):
    taken_token_logprobs(model, ids, valid=jnp.ones((2, 5), bool))


def _slow_decay_hybrid():
  """Tiny Qwen3.5 stack whose DeltaNet heads decay slowly (log decay ~ -0.01 per token)."""
  model = tiny_model(hybrid=True, deltanet_chunk_size=64, max_position_embeddings=2048)
  for layer in model.layers:
    if layer.layer_type == "linear_attention":
      mixer = layer.linear_attn
      mixer.in_proj_a.kernel[...] = 1e-4 * mixer.in_proj_a.kernel[...]
      mixer.dt_bias[...] = jnp.zeros_like(mixer.dt_bias[...])
      mixer.A_log[...] = jnp.full_like(mixer.A_log[...], np.log(0.01 / np.log(2.0)))
  return model


def test_padding_never_reaches_real_tokens_even_when_non_finite():
  # 40 real tokens, then 1,000 right-pad tokens (one id repeated) whose embedding is NaN: the
  # real-token logprobs equal the unpadded ones, padding scores exactly 0, and the loss
  # gradient is finite (no 0 * NaN anywhere).
  model = _slow_decay_hybrid()
  pad_id, real_len, pad = 3, 40, 1000
  table = model.embed_tokens.embedding
  table[...] = table[...].at[pad_id].set(jnp.nan)
  real = np.random.default_rng(0).integers(4, 61, real_len).astype(np.int32)
  ids = jnp.asarray(np.concatenate([real, np.full(pad, pad_id, np.int32)])[None])
  valid = jnp.arange(real_len + pad)[None] < real_len

  @nnx.jit
  def logp(m, x, v):
    return taken_token_logprobs(m, x, valid=v, chunk_size=64, with_entropy=True)

  alone, _ = logp(model, jnp.asarray(real[None]), jnp.ones((1, real_len), bool))
  padded, entropy = logp(model, ids, valid)
  assert np.all(np.asarray(padded[:, real_len:]) == 0.0)
  assert np.all(np.asarray(entropy[:, real_len:]) == 0.0)
  np.testing.assert_allclose(padded[:, :real_len], alone, atol=1e-5, rtol=0)

  loss_mask = valid.at[:, 0].set(False).astype(jnp.float32)
  grads = nnx.jit(nnx.grad(lambda m: -(logp(m, ids, valid)[0] * loss_mask).sum()))(model)
  for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads)):
    assert np.isfinite(np.asarray(g)).all(), path


@pytest.mark.parametrize("save_probs", [False, True])
def test_chunked_logprobs_gradient_matches_full(save_probs):
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(2, 7, 5)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(5, 13)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 13, (2, 7)))
  weights = jnp.asarray(rng.normal(size=(2, 7)), jnp.float32)  # a cotangent that is not all ones

  def full(h, w):
    lp = jax.nn.log_softmax(h @ w / 0.7, axis=-1)
    return (jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0] * weights).sum()

  def chunked(h, w):
    logp, ent = chunked_logprobs(h, w, targets, chunk_size=3, temperature=0.7,
                                 with_entropy=True, save_probs=save_probs)
    return (logp * weights).sum() + 0 * ent.sum()  # the entropy carries no gradient

  for got, want in zip(jax.grad(chunked, (0, 1))(hidden, kernel),
                       jax.grad(full, (0, 1))(hidden, kernel)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("save_probs, dots", [(False, 4), (True, 3)])
def test_saved_probs_skip_the_logits_recompute(save_probs, dots):
  # Forward: one logits matmul per chunk. Backward: d_hidden and d_kernel, plus the recomputed
  # logits unless the softmax was kept.
  hidden, kernel = jnp.zeros((2, 8, 4)), jnp.zeros((4, 16))
  targets = jnp.zeros((2, 8), jnp.int32)
  loss = lambda h, w: chunked_logprobs(h, w, targets, chunk_size=4, save_probs=save_probs)[0].sum()
  jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(hidden, kernel))
  assert jaxpr.count("dot_general[") == dots, jaxpr


def test_no_full_logits_in_the_backward_pass():
  # The rematerialised chunk body keeps only [B, C, V] logits live: the compiled temp memory
  # must stay far below the [B, T, V] float32 tensor.
  b, t, d, v = 2, 512, 8, 4096
  hidden = jnp.zeros((b, t, d))
  kernel = jnp.zeros((d, v))
  targets = jnp.zeros((b, t), jnp.int32)
  grad = jax.jit(jax.grad(lambda h, w: chunked_logprobs(h, w, targets, chunk_size=32)[0].sum(),
                          (0, 1)))
  temp = grad.lower(hidden, kernel).compile().memory_analysis().temp_size_in_bytes
  full_logits = b * t * v * 4
  assert temp < full_logits / 4, (temp, full_logits)


# Collective opcodes in compiled HLO (async forms included).
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo: str) -> list[tuple[str, int, bool]]:
  """`(op, result elements, in a loop)` of every collective in a compiled HLO module; in a
  loop: in the computations a `while` runs (body, condition and everything they call)."""
  bodies: dict[str, list[str]] = {}
  name = None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$", line)
    if head:
      name = head.group(1)
      bodies[name] = []
    elif name is not None and line.startswith("  "):
      bodies[name].append(line)
  callee = re.compile(r"(?:body|condition|calls|to_apply)=%?([\w.\-]+)")
  todo = [c for lines in bodies.values() for line in lines if " while(" in line
          for c in re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)]
  in_loop = set()
  while todo:
    c = todo.pop()
    if c not in in_loop and c in bodies:
      in_loop.add(c)
      todo += [x for line in bodies[c] for x in callee.findall(line)]
  found = []
  op = re.compile(r"= \(?\w+\[([\d,]*)\][^=]*?\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(")
  for n, lines in bodies.items():
    for line in lines:
      for dims, kind in op.findall(line):
        found.append((kind, int(np.prod([int(d) for d in dims.split(",") if d])), n in in_loop))
  return found


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2)])
def test_logits_head_backward_reduces_the_unembedding_gradient_once(mesh_shape):
  # 9B-like layout at toy width: FSDP-sharded [D, V] unembedding (vocab over "tensor" too in
  # the second mesh), batch over data x fsdp, 8 chunks. No collective in the compiled chunk
  # loops moves the unembedding or its gradient (under tensor parallelism only [B, C] softmax
  # statistics and [B, C, D] partial sums do); the unembedding is gathered once and its
  # gradient reduced once, outside them. (Before: 2 all-gathers and 1 all-reduce of [D, V]
  # per chunk.)
  from jax.sharding import NamedSharding, PartitionSpec as P
  from bat_jax import sharding
  mesh = sharding.make_mesh(*mesh_shape)
  batch, length, dim, vocab = 8, 64, 16, 64
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(batch, length, dim)), jnp.bfloat16)
  kernel = jnp.asarray(rng.normal(size=(dim, vocab)) * 0.3, jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
  weights = jnp.asarray(rng.normal(size=(batch, length)), jnp.float32)
  rows = NamedSharding(mesh, P(("data", "fsdp")))
  kernel_sharding = NamedSharding(mesh, P("fsdp", "tensor"))
  loss = lambda h, w: (chunked_logprobs(h, w, targets, chunk_size=8)[0] * weights).sum()
  grad = jax.jit(jax.grad(loss, (0, 1)), in_shardings=(rows, kernel_sharding),
                 out_shardings=(rows, kernel_sharding))
  with sharding.activation_sharding(mesh):
    compiled = grad.lower(hidden, kernel).compile()
  ops = collectives(compiled.as_text())
  kernel_slice = dim * vocab // mesh_shape[2]          # one device's gathered [D, V / tensor]
  in_loop = [(kind, n) for kind, n, loop in ops if loop]
  assert all(kind == "all-reduce" and n <= batch * 8 * dim for kind, n in in_loop), in_loop
  assert bool(in_loop) == (mesh_shape[2] > 1), in_loop
  outside = [(kind, n) for kind, n, loop in ops if not loop and n >= kernel_slice // 8]
  assert sum(kind == "all-gather" for kind, _ in outside) == 1, ops           # the kernel
  assert sum(kind in ("all-reduce", "reduce-scatter") for kind, _ in outside) == 1, ops
  got = compiled(jax.device_put(hidden, rows), jax.device_put(kernel, kernel_sharding))
  want = jax.jit(jax.grad(loss, (0, 1)))(hidden, kernel)  # one device, no mesh
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                             rtol=2e-2, atol=2e-2)
