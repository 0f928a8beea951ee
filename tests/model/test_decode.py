"""Cached incremental decoding equals the full forward; `valid` padding is inert."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bat_jax.model import DeltaNetState, KVCache, ModelConfig, build_model
from hf_fixtures import jit_call, qwen3_5_text_config, qwen3_config

FAMILIES = {
    "qwen3": qwen3_config(),
    "qwen3_5": qwen3_5_text_config(layer_types=["linear_attention", "full_attention"],
                                   num_hidden_layers=2),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_and_ids(request):
  # Chunk 8 so a 13-token prefill spans two DeltaNet chunks.
  cfg = ModelConfig.from_hf_dict(FAMILIES[request.param]).replace(deltanet_chunk_size=8)
  model = build_model(cfg, rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, size=(3, 20)), jnp.int32)
  return model, ids, jit_call(model, ids)


def test_prefill_then_token_by_token_equals_full_forward(model_and_ids):
  model, ids, full = model_and_ids
  # valid is always passed (all True here) so every test reuses the same compilations.
  cache = model.init_cache(3, 24)
  logits, cache = jit_call(model, ids[:, :13], cache=cache, valid=jnp.ones((3, 13), bool))
  outs = [logits]
  for t in range(13, 20):
    logits, cache = jit_call(model, ids[:, t:t + 1], cache=cache, valid=jnp.ones((3, 1), bool))
    outs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, [20, 20, 20])


def test_ragged_valid_prefill_then_decode_equals_full_forward(model_and_ids):
  model, ids, full = model_and_ids
  lens = np.array([5, 13, 1])
  valid = jnp.arange(13)[None, :] < lens[:, None]
  padded = jnp.where(valid, ids[:, :13], 3)  # junk tokens in the padding
  logits, cache = jit_call(model, padded, cache=model.init_cache(3, 24), valid=valid)
  for b, n in enumerate(lens):
    np.testing.assert_allclose(logits[b, :n], full[b, :n], atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, lens)
  for step in range(3):
    nxt = jnp.asarray([[ids[b, n + step]] for b, n in enumerate(lens)])
    logits, cache = jit_call(model, nxt, cache=cache, valid=jnp.ones((3, 1), bool))
    for b, n in enumerate(lens):
      np.testing.assert_allclose(logits[b, 0], full[b, n + step], atol=1e-5)
  # Without a cache, valid-masked right padding does not change valid logits either.
  no_cache = jit_call(model, padded, valid=valid)
  for b, n in enumerate(lens):
    np.testing.assert_allclose(no_cache[b, :n], full[b, :n], atol=1e-5)


def test_invalid_decode_rows_leave_cache_untouched(model_and_ids):
  model, ids, _ = model_and_ids
  _, cache = jit_call(model, ids[:, :13], cache=model.init_cache(3, 24),
                     valid=jnp.arange(13)[None, :] < 6)
  valid = jnp.array([[True], [False], [True]])
  _, after = jit_call(model, ids[:, 13:14], cache=cache, valid=valid)
  np.testing.assert_array_equal(after.lengths, [7, 6, 7])
  kinds = set()
  for old, new in zip(cache.layers, after.layers):
    kinds.add(type(old))
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
      np.testing.assert_array_equal(a[1], b[1])  # the masked row
      assert not np.array_equal(a[0], b[0])      # a live row did change
  expected = {KVCache} if model.config.model_type == "qwen3" else {KVCache, DeltaNetState}
  assert kinds == expected


def test_hidden_states_times_unembed_is_logits(model_and_ids):
  model, ids, full = model_and_ids
  hidden = nnx.jit(lambda m, x: m.hidden_states(x))(model, ids)
  assert hidden.shape == (3, 20, model.config.hidden_size)
  np.testing.assert_allclose(hidden @ model.unembed_kernel(), full, atol=1e-5)
  assert model.unembed_kernel().shape == (model.config.hidden_size, model.config.vocab_size)


def test_remat_policy_keeps_loss_and_gradients(model_and_ids):
  model, ids, _ = model_and_ids
  if not model.config.is_hybrid:
    pytest.skip("remat wraps layers generically; the hybrid model covers both layer kinds")
  graphdef, params = nnx.split(model)

  def loss(p, policy):
    hidden = nnx.merge(graphdef, p).hidden_states(ids, remat_policy=policy)
    return jnp.mean(jnp.sin(hidden))

  plain = jax.jit(jax.value_and_grad(lambda p: loss(p, None)))(params)
  remat = jax.jit(jax.value_and_grad(
      lambda p: loss(p, jax.checkpoint_policies.nothing_saveable)))(params)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  with pytest.raises(ValueError, match="remat_policy"):
    model.hidden_states(ids, cache=model.init_cache(3, 24),
                        remat_policy=jax.checkpoint_policies.nothing_saveable)
