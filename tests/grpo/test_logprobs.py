"""Chunked taken-token logprobs against the full `[B, T, V]` log-softmax."""

import jax
import jax.numpy as jnp
import numpy as np

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
    logp, ent = jax.jit(lambda x: taken_token_logprobs(model, x, chunk_size=chunk,
                                                       temperature=0.7, with_entropy=True))(ids)
    assert logp.shape == ids.shape and np.all(np.asarray(logp[:, 0]) == 0.0)
    np.testing.assert_allclose(logp[:, 1:], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent[:, 1:], want_ent, rtol=1e-5, atol=1e-5)


def test_chunked_logprobs_gradient_matches_full():
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(2, 7, 5)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(5, 13)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 13, (2, 7)))

  def full(h, w):
    lp = jax.nn.log_softmax(h @ w, axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], axis=-1).sum()

  chunked = lambda h, w: chunked_logprobs(h, w, targets, chunk_size=3)[0].sum()
  for got, want in zip(jax.grad(chunked, (0, 1))(hidden, kernel),
                       jax.grad(full, (0, 1))(hidden, kernel)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


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
