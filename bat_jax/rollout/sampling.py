"""Per-row token sampling (temperature, top-k, top-p) and the trainer's logprob quantity.

Logprob semantics: `token_logprobs` is log softmax(logits) at temperature 1 over the FULL
vocabulary, the quantity GRPO recomputes from the same params (`bat_jax.grpo.logprobs`).
The sampler draws from a different distribution q: logits / temperature, then top-k, then
top-p truncation, renormalised. Consequences for training:

* temperature = 1, top_k = -1, top_p = 1: q equals the policy, the reported logprob is exactly
  the behaviour logprob, and the first GRPO step is on-policy (ratio 1).
* temperature != 1 or truncation: tokens are drawn from q but scored under the policy. Tokens
  outside the top-p/top-k support are never drawn, so their (negative) advantage never
  reaches the gradient, and the PPO ratio pi_new / pi_old is measured against the policy, not
  against q. This is the usual practice (verl / slime / SGLang return the same quantity); keep
  top_p = 1 for unbiased rollouts, or train with the matching temperature on both sides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def token_logprobs(logits: Array, tokens: Array) -> Array:
  """log softmax(logits)[token] at temperature 1. logits [S, V] f32, tokens [S] -> [S]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def sample_tokens(logits: Array, key: Array, *, temperature: Array, top_p: Array,
                  top_k: Array, min_p: Array | None = None) -> Array:
  """Draws one token per row.

  Args:
    logits: [S, V] float32 raw logits.
    key: PRNG key.
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
  safe_t = jnp.where(temperature > 0, temperature, 1.0)
  scaled = logits / safe_t[:, None]
  min_p = jnp.zeros_like(top_p) if min_p is None else min_p

  def unfiltered(_):
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)

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
    choice = jax.random.categorical(key, jnp.where(keep, ranked, -jnp.inf), axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

  # The full-vocabulary sort only runs when some row truncates.
  needs_filter = (jnp.any((top_k > 0) & (top_k < vocab)) | jnp.any(top_p < 1.0)
                  | jnp.any(min_p > 0))
  sampled = jax.lax.cond(needs_filter, filtered, unfiltered, None)
  return jnp.where(temperature > 0, sampled, greedy)
