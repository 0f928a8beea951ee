"""Per-row token sampling (temperature, top-k, top-p) and the logprob every engine reports.

Logprob contract (the same in the JAX engine, `bat_jax.rollout.server` and SGLang 0.5.23): the
reported logprob of a sampled token is log softmax(logits / T) over the FULL vocabulary, where T is the
request's temperature, or 1 for greedy (T = 0). That is the distribution the sampler drew from
before top-k / top-p truncation; SGLang's `Sampler.forward` returns exactly this
(`log(softmax(logits / T))`, the truncated renormalisation is a local copy). The trainer
recomputes the same quantity as log softmax(logits / T), so with equal params the two agree up
to float error, and GRPO's truncated importance sampling (`grpo.tis_cap`) corrects for what
is left (bf16 serving, a stale server). Truncation (top_k, top_p < 1) is not in the reported
logprob: keep top_p = 1 and top_k = -1 for unbiased rollouts.

Seeded rows (a request's `seed`): the token at absolute position p is drawn with the row's own
key fold_in(key(seed), p) (`row_keys`), so it depends only on (seed, p, that row's logits), never
on the batch, the slot or where a decode block started. Unseeded rows share the engine's key
for the step, as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def effective_temperature(temperature: Array) -> Array:
  """The temperature of the distribution actually sampled: T, or 1 for greedy (T = 0)."""
  return jnp.where(temperature > 0, temperature, 1.0)


def token_logprobs(logits: Array, tokens: Array, temperature: Array) -> Array:
  """log softmax(logits / T)[token]. logits [S, V], tokens [S], temperature [S] -> [S] f32.

  T = 0 (greedy) is scored at T = 1, like SGLang.
  """
  scaled = logits.astype(jnp.float32) / effective_temperature(temperature)[:, None]
  logp = jax.nn.log_softmax(scaled, axis=-1)
  return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def seed_key_data(seed: int) -> np.ndarray:
  """uint32 [2] raw threefry key data for a 64-bit seed, signed or not (OpenAI allows both).

  Equal to `jax.random.key_data(jax.random.key(seed))` for 0 <= seed < 2**31.
  """
  bits = int(seed) % (1 << 64)
  return np.array([bits >> 32, bits & 0xFFFFFFFF], np.uint32)


def position_keys(seed_data: Array, positions: Array) -> Array:
  """Per-row sampling keys fold_in(key(seed), position). seed_data [S, 2] uint32, positions [S]."""
  return jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(seed_data), positions)


def sample_tokens(logits: Array, key: Array, *, temperature: Array, top_p: Array,
                  top_k: Array, min_p: Array | None = None, row_keys: Array | None = None,
                  seeded: Array | None = None) -> Array:
  """Draws one token per row.

  Args:
    logits: [S, V] float32 raw logits.
    key: PRNG key of the unseeded rows (one draw over the batch).
    row_keys, seeded: optional [S] keys and [S] bool; a seeded row draws with its own key.
    temperature: [S]; 0 means greedy (argmax).
    top_p: [S] nucleus mass in (0, 1].
    top_k: [S] int; <= 0 disables it.
    min_p: [S] or None; keeps tokens with probability >= min_p * the top token's (after
      temperature), as SGLang; 0 disables it.

  Returns:
    [S] int32 token ids.
  """
  vocab = logits.shape[-1]
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / effective_temperature(temperature)[:, None]
  min_p = jnp.zeros_like(top_p) if min_p is None else min_p

  def draw(rows):  # [S, V] -> [S]
    shared = jax.random.categorical(key, rows, axis=-1)
    if row_keys is None:
      return shared
    own = lambda: jax.vmap(jax.random.categorical)(row_keys, rows)  # noqa: E731
    return jax.lax.cond(jnp.any(seeded), lambda: jnp.where(seeded, own(), shared),
                        lambda: shared)

  def unfiltered(_):
    return draw(scaled).astype(jnp.int32)

  def filtered(_):
    order = jnp.argsort(-scaled, axis=-1)                               # [S, V] descending
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = rank < jnp.where(top_k > 0, top_k, vocab)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < top_p[:, None]                                # rank 0 always kept
    # min_p: p_i >= min_p * p_max  <=>  scaled_i >= scaled_max + log(min_p) (rank 0 kept).
    keep &= (ranked >= ranked[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]) | (
        min_p[:, None] <= 0)
    choice = draw(jnp.where(keep, ranked, -jnp.inf))
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

  # The full-vocabulary sort only runs when some row truncates.
  needs_filter = (jnp.any((top_k > 0) & (top_k < vocab)) | jnp.any(top_p < 1.0)
                  | jnp.any(min_p > 0))
  sampled = jax.lax.cond(needs_filter, filtered, unfiltered, None)
  return jnp.where(temperature > 0, sampled, greedy)
