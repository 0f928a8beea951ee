"""The shared trainer: state created, restored and loaded straight onto the mesh; the logprob pass
on the step's micro-batches; one compile per shape.

Sharding checks run on 8 fake CPU devices (tests/conftest.py) with a model whose big leaves are
>= 1 MiB, so "sharded across the mesh" is about real-sized tensors, not replicated scraps.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax import sharding
from bat_jax.checkpointing import Checkpointer
from bat_jax.grpo import GrpoConfig, grpo_loss_fn, taken_token_logprobs
from bat_jax.model import build_model, load_pretrained, save_pretrained
from bat_jax.train import (LogprobPassConfig, OptimizerConfig, StepConfig, Trainer,
                           TrainerConfig)
from policy_fixtures import grpo_batch, tiny_config, tiny_model

MIB = 2**20
RULES = sharding.DEFAULT_RULES


def wide_config():
  """Hybrid Qwen3.5 whose embedding, MLP and projections are >= 1 MiB in fp32."""
  return tiny_config(hybrid=True, vocab_size=1024, hidden_size=256, intermediate_size=1024,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=64,
                     linear_value_head_dim=64)


def fsdp_mesh():
  return sharding.make_mesh(data=1, fsdp=8, tensor=1)


def wide_trainer(**kw) -> Trainer:
  abstract = nnx.eval_shape(lambda: build_model(wide_config(), rngs=nnx.Rngs(0)))
  cfg = TrainerConfig(optimizer=OptimizerConfig(learning_rate=1e-3), **kw)
  return Trainer.for_model(abstract, grpo_loss_fn(GrpoConfig()), cfg, fsdp_mesh(), RULES)


def assert_big_leaves_sharded(tree, what: str) -> int:
  """Every leaf of >= 1 MiB is split over all 8 devices (each holds 1/8); returns their count."""
  big = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if leaf.nbytes < MIB:
      continue
    big += 1
    name = f"{what}{jax.tree_util.keystr(path)}"
    assert len(leaf.sharding.device_set) == 8, name
    shard = int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
    assert shard * 8 == leaf.nbytes, f"{name}: {leaf.sharding.spec} keeps {shard} of {leaf.nbytes}"
  return big


def test_init_creates_params_and_moments_on_their_shards():
  trainer = wide_trainer()
  params = trainer.init_params(lambda: build_model(wide_config(), rngs=nnx.Rngs(0)))
  # The eager init's values with the same seed (to float rounding: XLA fuses the scaling).
  eager = nnx.state(build_model(wide_config(), rngs=nnx.Rngs(0)), nnx.Param)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(eager)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)
  state = trainer.init_state(params)
  big = assert_big_leaves_sharded(state.params, "params")
  assert big >= 6  # embedding, MLP and attention / DeltaNet projections
  assert assert_big_leaves_sharded(state.opt_state, "opt_state") == 2 * big  # mu and nu


def test_resume_restores_straight_into_the_target_shardings(tmp_path):
  trainer = wide_trainer()
  state = trainer.init_state(
      trainer.init_params(lambda: build_model(wide_config(), rngs=nnx.Rngs(1))))
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(3, state.replace(step=state.step + 3))
  fresh = wide_trainer()

  def no_init():
    raise AssertionError("a resume must not build fresh params")

  with Checkpointer(tmp_path) as ckpt:
    restored, info = fresh.restore_or_init(ckpt, no_init)
  assert info.step == 3 and int(restored.step) == 3
  big = assert_big_leaves_sharded(restored.params, "params")
  assert big >= 6 and assert_big_leaves_sharded(restored.opt_state, "opt_state") == 2 * big
  for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hf_load_places_each_tensor_on_its_shards(tmp_path):
  save_pretrained(build_model(wide_config(), rngs=nnx.Rngs(2)), tmp_path / "hf")
  model = load_pretrained(tmp_path / "hf", mesh=fsdp_mesh(), rules=RULES)
  trainer = wide_trainer()
  state = trainer.init_state(nnx.state(model, nnx.Param))
  big = assert_big_leaves_sharded(nnx.state(model, nnx.Param), "loaded")
  assert big >= 6 and assert_big_leaves_sharded(state.opt_state, "opt_state") == 2 * big


def test_logprob_pass_matches_the_full_batch_and_ignores_padding():
  model = tiny_model(hybrid=True)
  batch = grpo_batch(3)
  valid = (batch["loss_mask"] > 0) | (np.arange(12)[None] < 4)
  valid = np.cumprod(valid, axis=1).astype(np.int32)  # right padding: a prefix of each row
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  trainer = Trainer.for_model(model, grpo_loss_fn(GrpoConfig(logprob_chunk_size=5)),
                              TrainerConfig(optimizer=OptimizerConfig()), mesh, RULES)
  params = trainer.place(nnx.state(model, nnx.Param))
  cfg = LogprobPassConfig(num_micro_batches=2, chunk_size=5, temperature=0.7)
  got = trainer.logprobs(params, {**batch, "valid": valid}, cfg)
  want = taken_token_logprobs(model, jnp.asarray(batch["input_ids"]), valid=jnp.asarray(valid),
                              chunk_size=5, temperature=0.7)[0]
  real = valid.astype(bool)
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-6)
  assert got.sharding.spec[0] == ("data", "fsdp")  # the step's batch sharding
  # Pad content never reaches a real position.
  noisy = np.where(real, batch["input_ids"], 7).astype(np.int32)
  again = trainer.logprobs(params, {"input_ids": noisy, "valid": valid}, cfg)
  np.testing.assert_array_equal(np.asarray(again)[real], np.asarray(got)[real])
  assert list(trainer.memory) == ["logprobs(8, 12)"]  # one compile, reused


def test_step_compiles_once_per_shape_and_keeps_fp32_masters_under_bf16_weights():
  model = tiny_model()
  trainer = Trainer.for_model(model, grpo_loss_fn(GrpoConfig(logprob_chunk_size=5)),
                              TrainerConfig(optimizer=OptimizerConfig(learning_rate=1e-2),
                                            step=StepConfig(weight_dtype="bfloat16")),
                              sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), RULES)
  state = trainer.init_state(nnx.state(model, nnx.Param))
  batch = grpo_batch(1)
  first = trainer.compiled_step(batch)
  assert trainer.compiled_step(grpo_batch(2)) is first
  assert trainer.memory["step(8, 12)"]["temp_size_in_bytes"] > 0
  new, metrics = trainer.step(state, batch)
  assert int(metrics["update_applied"]) == 1 and np.isfinite(float(metrics["loss"]))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.params))
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(new.params), jax.tree.leaves(nnx.state(model, nnx.Param))))
