"""The JAX engine's compiled programs (static arguments: the model's graphdef and the engine
config), jitted at module level so engines of the same model share them.

* `init_cache` / `reset_rows`: an empty cache; zero the rows that start a conversation.
* `prefill_rows`: feeds one chunk to the cache rows that have new tokens, a row at a time.
* `decode_block`: up to `decode_block` steps of sample -> logprob -> feed over all slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from bat_jax.rollout.sampling import position_keys, sample_tokens, token_logprobs

Array = jax.Array


def _logits(model, hidden: Array) -> Array:
  """[S, D] hidden -> [S, V] float32 logits, exactly as the trainer computes them."""
  return jnp.einsum("sd,dv->sv", hidden, model.unembed_kernel(),
                    preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_cache(graphdef, cfg, params):
  model = nnx.merge(graphdef, params)
  return model.init_cache(cfg.num_slots, cfg.max_len, cfg.cache_dtype)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def reset_rows(graphdef, cfg, params, cache, rows: Array):
  """Zeroes the cache rows where rows [S] is True (a new conversation starts there)."""
  fresh = nnx.merge(graphdef, params).init_cache(cfg.num_slots, cfg.max_len, cfg.cache_dtype)

  def pick(old, new):
    if old.ndim == 0 or old.shape[0] != cfg.num_slots:
      raise ValueError(f"cache leaf of shape {old.shape} has no leading slot axis of size "
                       f"{cfg.num_slots}; JaxEngine needs batch-major caches")
    return jnp.where(rows.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
  return jax.tree.map(pick, cache, fresh)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4, 5))
def prefill_rows(graphdef, cfg, span: int, params, cache, last_logits, rows, n_rows, tokens,
                 valid, positions, last_idx):
  """Feeds one chunk to the cache rows `rows[:n_rows]` (distinct slots), one row at a time:
  tokens / valid / positions [S, C] and last_idx [S] (-1: no last token here) are aligned with
  `rows` [S]; attention reads the first `span` cache slots (the fed rows end below it).

  A row at a time, so a call costs what its rows need (a turn joining a running batch does not
  compute every slot) and a row's numbers never depend on which rows share its call.
  Returns the new cache and last_logits [S, V], replaced for rows whose last token was fed.
  """
  del cfg
  model = nnx.merge(graphdef, params)

  def one_row(i, carry):
    cache, last_logits = carry
    slot = rows[i]
    take = lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, slot, 1, axis=0)
    pick = lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1, axis=0)
    hidden, row_cache = model.hidden_states(pick(tokens), positions=pick(positions),
                                            cache=jax.tree.map(take, cache),
                                            valid=pick(valid), attend_span=span)
    cache = jax.tree.map(lambda leaf, new: jax.lax.dynamic_update_slice_in_dim(
        leaf, new, slot, axis=0), cache, row_cache)
    last = last_idx[i]
    logits = _logits(model, jax.lax.dynamic_index_in_dim(hidden[0], jnp.maximum(last, 0), 0))
    fed = jnp.where(last >= 0, logits, jax.lax.dynamic_slice_in_dim(last_logits, slot, 1, 0))
    return cache, jax.lax.dynamic_update_slice_in_dim(last_logits, fed, slot, axis=0)

  return jax.lax.fori_loop(0, n_rows, one_row, (cache, last_logits))


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4, 5))
def decode_block(graphdef, cfg, span: int, params, cache, last_logits,
                  lengths, active, budget, temperature, top_p, top_k, min_p, stop_ids, seed_data,
                  seeded, key):
  """Up to cfg.decode_block steps of sample -> logprob -> feed, stopping when no row is active;
  attention reads the first `span` cache slots (the active rows end below it).

  Per row [S]: lengths (tokens in the cache), active, budget (tokens it may still emit),
  temperature / top_p / top_k / min_p; stop_ids [S, K] (-1 padded); seed_data [S, 2] and
  seeded [S]: a seeded row samples position p with fold_in(key(seed), p), not `key`. Returns the new cache, logits,
  lengths, active, budget, the emitted tokens and logprobs [S, decode_block], how many each
  row emitted [S], and the advanced key.
  """
  n_slots, steps = cfg.num_slots, cfg.decode_block

  def cond(c):
    return (c["step"] < steps) & jnp.any(c["active"])

  def body(c):
    model = nnx.merge(graphdef, params)
    key, sub = jax.random.split(c["key"])
    emit = c["active"]
    tok = sample_tokens(c["logits"], sub, temperature=temperature, top_p=top_p, top_k=top_k,
                        min_p=min_p, row_keys=position_keys(seed_data, c["lengths"]),
                        seeded=seeded)
    logp = token_logprobs(c["logits"], tok, temperature)
    # Feed every emitted token (the stop token too) so the cache holds the whole history.
    hidden, cache = model.hidden_states(tok[:, None], positions=c["lengths"][:, None],
                                        cache=c["cache"], valid=emit[:, None],
                                        attend_span=span)
    logits = jnp.where(emit[:, None], _logits(model, hidden[:, 0]), c["logits"])
    budget = c["budget"] - emit
    stopped = jnp.any(tok[:, None] == stop_ids, axis=-1)
    column = (0, c["step"])
    return dict(
        step=c["step"] + 1, key=key, cache=cache, logits=logits, lengths=c["lengths"] + emit,
        budget=budget, active=emit & ~stopped & (budget > 0),
        tok=jax.lax.dynamic_update_slice(c["tok"], jnp.where(emit, tok, 0)[:, None], column),
        logp=jax.lax.dynamic_update_slice(c["logp"], jnp.where(emit, logp, 0.0)[:, None],
                                          column),
        n_out=c["n_out"] + emit)

  init = dict(step=jnp.int32(0), key=key, cache=cache, logits=last_logits, lengths=lengths,
              budget=budget, active=active, tok=jnp.zeros((n_slots, steps), jnp.int32),
              logp=jnp.zeros((n_slots, steps), jnp.float32),
              n_out=jnp.zeros((n_slots,), jnp.int32))
  c = jax.lax.while_loop(cond, body, init)
  return (c["cache"], c["logits"], c["lengths"], c["active"], c["budget"], c["tok"], c["logp"],
          c["n_out"], c["key"])
