"""`guarded_adamw`: optax's AdamW arithmetic with the finite guard inside, and no moment copies.

The copies it removes are XLA's (copy insertion on the donated moments), so the last test reads
the compiled step's HLO: with optax's update guarded afterwards every moment is copied; with
`guarded_adamw` none is.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from bat_jax.train import (OptimizerConfig, StepConfig, build_step_fn, init_train_state,
                           make_optimizer, make_schedule, split_model)
from bat_jax.train.guarded_adamw import guarded_adamw
from flax import nnx

CONFIGS = [OptimizerConfig(learning_rate=1e-2, max_grad_norm=1.0),
           OptimizerConfig(learning_rate=3e-3, max_grad_norm=None, weight_decay=0.1,
                           schedule="cosine", warmup_steps=2, total_steps=5, b1=0.8)]


def _tree(seed, scale=1.0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return {"a": scale * jax.random.normal(k1, (4, 3)), "b": scale * jax.random.normal(k2, (5,))}


@pytest.mark.parametrize("cfg", CONFIGS, ids=["clip", "decay_cosine"])
def test_matches_optax_over_steps(cfg):
  optimizer, update = make_optimizer(cfg), guarded_adamw(cfg, make_schedule(cfg))
  params_a = params_b = _tree(0)
  state_a = state_b = optimizer.init(params_a)
  for i in range(4):
    grads = _tree(10 + i, scale=3.0)
    updates, state_a = optimizer.update(grads, state_a, params_a)
    params_a = optax.apply_updates(params_a, updates)
    params_b, state_b = update(grads, state_b, params_b, jnp.array(True))
    assert jax.tree.structure(state_b) == jax.tree.structure(state_a)
    for a, b in zip(jax.tree.leaves((params_a, state_a)), jax.tree.leaves((params_b, state_b))):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["clip", "decay_cosine"])
def test_failed_guard_keeps_everything(cfg):
  optimizer, update = make_optimizer(cfg), guarded_adamw(cfg, make_schedule(cfg))
  params = _tree(0)
  state = optimizer.update(_tree(1), optimizer.init(params), params)[1]  # count 1, moments set
  new_params, new_state = update(_tree(2), state, params, jnp.array(False))
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((new_params, new_state))):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


class _Mlp(nnx.Module):
  def __init__(self):
    self.a = nnx.Param(jnp.zeros((256, 128)))
    self.b = nnx.Param(jnp.zeros((128, 256)))

  def __call__(self, x):
    return jnp.tanh(x @ self.a[...]) @ self.b[...]


def _loss(model, batch, ref_model, policy):
  del ref_model, policy
  out = model(batch["x"])
  return jnp.sum(out ** 2), jnp.float32(out.shape[0]), {"tokens": jnp.float32(1.0),
                                                          "sequences": jnp.float32(1.0)}


def _moment_copies(optimizer_cfg) -> int:
  """Copies of f32 entry parameters in the compiled, donated, 8-way FSDP step."""
  cfg = OptimizerConfig(learning_rate=1e-3)
  graphdef, params, rest = split_model(_Mlp())
  optimizer = make_optimizer(cfg)
  step = build_step_fn(graphdef, _loss, optimizer, StepConfig(num_micro_batches=2),
                       optimizer_cfg=cfg if optimizer_cfg else None)
  mesh = jax.make_mesh((8,), ("fsdp",))
  state = init_train_state(params, optimizer, seed=0)
  shardings = jax.tree.map(
      lambda x: NamedSharding(mesh, P("fsdp") if x.ndim == 2 else P()), state)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          state, shardings)
  x = jax.ShapeDtypeStruct((16, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
  compiled = jax.jit(step, donate_argnums=0, out_shardings=(shardings, None)).lower(
      abstract, {"x": x}, {"rest": rest, "ref_params": None}).compile()
  # Entry parameters are `%param` / `%param.N` (a fusion's own are `%param_0.N`).
  return len(re.findall(r"= f32\[[0-9,]+\]\{[0-9,]+\} copy\(%param(\.[0-9]+)?\)",
                        compiled.as_text()))


def test_step_copies_no_moment():
  assert _moment_copies(optimizer_cfg=False) >= 4  # optax guarded afterwards: mu, nu of a, b
  assert _moment_copies(optimizer_cfg=True) == 0
