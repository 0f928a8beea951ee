"""Scanned layer cycles (`scan_layers=True`) vs one module per layer: same function, same grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bat_jax.model import ModelConfig, build_model
from hf_fixtures import qwen3_5_text_config, qwen3_config


def _pair(hf: dict):
  cfg = ModelConfig.from_hf_dict(hf)
  return (build_model(cfg, rngs=nnx.Rngs(0)),
          build_model(cfg.replace(scan_layers=False), rngs=nnx.Rngs(0)))


def _unstack_grads(scanned_grads, cfg):
  """Scanned grad tree -> {(layer, *rest): array} in HF layer order (plus non-layer leaves)."""
  out = {}
  for path, var in nnx.to_flat_state(scanned_grads):
    value = np.asarray(var.get_value())
    if path[0] == "layers":
      for c in range(cfg.num_cycles):
        out[("layers", c * cfg.layer_cycle + path[1], *path[2:])] = value[c]
    else:
      out[tuple(path)] = value
  return out


_HYBRID_2X2 = qwen3_5_text_config(num_hidden_layers=4,
                                  layer_types=["linear_attention", "full_attention"] * 2)


@pytest.mark.parametrize("hf", [pytest.param(_HYBRID_2X2, marks=pytest.mark.slow), qwen3_config()],
                         ids=["qwen3_5_2cycles", "qwen3"])
def test_scanned_equals_unscanned_hidden_and_grads(hf):
  scanned, flat = _pair(hf)
  cfg = scanned.config
  assert (cfg.layer_cycle, cfg.num_cycles) == ((2, 2) if cfg.is_hybrid else (1, 2))
  ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 11)), jnp.int32)
  valid = jnp.arange(11)[None] < jnp.array([[11], [7]])

  def loss(model, policy):
    hidden = model.hidden_states(ids, valid=valid, remat_policy=policy)
    return jnp.sum(jnp.where(valid[..., None], hidden, 0.0) ** 2)

  results = {}
  remat = jax.checkpoint_policies.nothing_saveable
  for name, model, policy in (("flat", flat, None), ("scanned", scanned, None),
                              ("scanned", scanned, remat)):
    value, grads = nnx.jit(nnx.value_and_grad(loss), static_argnums=1)(model, policy)
    results[name, policy is not None] = (value, grads)
  # Same init values, same function: logits and grads agree to float rounding.
  ref_value, ref_grads = results["flat", False]
  ref = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(ref_grads)}
  for key, (value, grads) in results.items():
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, err_msg=str(key))
    got = _unstack_grads(grads, cfg) if key[0] == "scanned" else {
        tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    assert got.keys() == ref.keys()
    for path in ref:  # fusion order differs: tolerance scaled to each leaf's magnitude
      scale = float(np.abs(ref[path]).max())
      np.testing.assert_allclose(got[path], ref[path], rtol=1e-3, atol=1e-4 * scale,
                                 err_msg=f"{key} {path}")


@pytest.mark.slow  # default-suite decode coverage: tests/model/test_decode.py (scanned default)
def test_scanned_cached_decode_matches_unscanned():
  scanned, flat = _pair(_HYBRID_2X2)
  ids = jnp.asarray(np.random.RandomState(1).randint(0, 97, (2, 9)), jnp.int32)
  step = nnx.jit(lambda m, x, c: m(x, cache=c))
  outs = []
  for model in (scanned, flat):
    logits, cache = step(model, ids[:, :6], model.init_cache(2, 16))
    for t in range(6, 9):
      more, cache = step(model, ids[:, t:t + 1], cache)
      logits = jnp.concatenate([logits, more], axis=1)
    outs.append(logits)
  np.testing.assert_allclose(outs[0], outs[1], atol=1e-5)
  np.testing.assert_allclose(outs[0], nnx.jit(lambda m, x: m(x))(scanned, ids), atol=1e-4)


def test_layer_cycle_detection():
  hf = qwen3_5_text_config(num_hidden_layers=6,
                           layer_types=["linear_attention", "full_attention"] * 3)
  assert ModelConfig.from_hf_dict(hf).layer_cycle == 2
  irregular = qwen3_5_text_config(num_hidden_layers=3, layer_types=[
      "linear_attention", "full_attention", "full_attention"])
  cfg = ModelConfig.from_hf_dict(irregular)
  assert (cfg.layer_cycle, cfg.num_cycles) == (3, 1)
  model = build_model(cfg, rngs=nnx.Rngs(0))
  assert model.layers[2].mlp.up_proj.kernel.get_value().shape == (1, 32, 48)
