"""Mesh, logical-axis rules, and a sharded forward on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from bat_jax import sharding
from bat_jax.model import ModelConfig, build_model


def _tiny_hybrid() -> ModelConfig:
  # Dims chosen to divide a tensor axis of 2 (vocab 96) so params really shard.
  return ModelConfig(model_type="qwen3_5_text", vocab_size=96, hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8,
                     layer_types=("linear_attention", "full_attention"),
                     partial_rotary_factor=0.5, linear_key_head_dim=8, linear_value_head_dim=8,
                     linear_num_key_heads=2, linear_num_value_heads=4, deltanet_chunk_size=8)


def test_make_mesh_shapes_and_errors():
  assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
  mesh = sharding.make_mesh(data=-1, fsdp=2, tensor=2)
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  one = sharding.make_mesh(devices=jax.devices()[:1])
  assert dict(one.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  with pytest.raises(ValueError, match="needs 12 devices, have 8"):
    sharding.make_mesh(data=3, fsdp=2, tensor=2)
  with pytest.raises(ValueError, match="at most one mesh axis"):
    sharding.make_mesh(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="do not split"):
    sharding.make_mesh(data=-1, fsdp=3)


def test_logical_rules():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  rules = sharding.DEFAULT_RULES
  assert sharding.logical_to_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
  assert sharding.logical_to_spec(("batch", None), rules) == P(("data", "fsdp"), None)
  # A mesh axis that does not divide the dim is dropped (vocab 97 on tensor=2).
  assert sharding.logical_to_spec(("vocab", "embed"), rules, shape=(97, 32),
                                  mesh=mesh) == P(None, "fsdp")
  # A mesh axis is never used twice in one spec.
  assert sharding.logical_to_spec(("mlp", "heads"), rules) == P("tensor", None)
  with pytest.raises(KeyError, match="'mystery'"):
    sharding.logical_to_spec(("mystery",), rules)
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    sharding.logical_to_spec(("embed",), (("embed", "model"),))
  assert sharding.batch_sharding(mesh, 3).spec == P(("data", "fsdp"), None, None)
  assert sharding.replicated(mesh).spec == P()


def test_model_shardings_follow_param_metadata():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  abstract = nnx.eval_shape(lambda: build_model(_tiny_hybrid(), rngs=nnx.Rngs(0)))
  shardings = sharding.model_shardings(abstract, mesh)
  state = nnx.state(abstract)
  assert jax.tree.structure(shardings) == jax.tree.structure(state)
  assert shardings["embed_tokens"]["embedding"].get_value().spec == P("tensor", "fsdp")
  # Scanned layout: layers[j] stacks cycle position j over cycles (leading "layers" axis).
  down = shardings["layers"][1]["mlp"]["down_proj"]["kernel"].get_value()
  assert down.spec == P(None, "tensor", "fsdp")
  assert shardings["layers"][0]["linear_attn"]["A_log"].get_value().spec == P(None, "tensor")
  assert shardings["norm"]["weight"].get_value().spec == P(None)


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 1, 1)], ids=["8dev", "1dev"])
def test_sharded_forward_equals_unsharded(mesh_shape):
  cfg = _tiny_hybrid()
  model = build_model(cfg, rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.RandomState(0).randint(0, 96, size=(4, 12)), jnp.int32)
  graphdef, state = nnx.split(model)
  forward = lambda st, x: nnx.merge(graphdef, st)(x)
  expected = jax.jit(forward)(state, ids)

  n = int(np.prod(mesh_shape))
  mesh = sharding.make_mesh(*mesh_shape, devices=jax.devices()[:n])
  param_sh = sharding.model_shardings(state, mesh)
  batch_sh = sharding.batch_sharding(mesh, 2)
  sharded_fwd = jax.jit(forward, in_shardings=(param_sh, batch_sh),
                        out_shardings=sharding.batch_sharding(mesh, 3))
  placed = jax.device_put(state, param_sh)
  kernel = placed["layers"][1]["mlp"]["gate_proj"]["kernel"][...]
  assert len(kernel.sharding.device_set) == n
  out = sharded_fwd(placed, jax.device_put(ids, batch_sh))
  assert out.sharding.spec == P(("data", "fsdp"), None, None)
  np.testing.assert_allclose(out, expected, atol=1e-5)

  # How the trainer places a model: device_put its state on model_shardings.
  model_state = nnx.state(model)
  nnx.update(model, jax.device_put(model_state, sharding.model_shardings(model_state, mesh)))
  table = model.embed_tokens.embedding[...]
  assert table.sharding.spec == P("tensor", "fsdp") and len(table.sharding.device_set) == n


def _lowered_hidden_states(mesh, ids, with_rules: bool):
  model = build_model(_tiny_hybrid(), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  repl = sharding.replicated(mesh)
  # A fresh jit per call: constraints are recorded at trace time.
  fwd = jax.jit(lambda st, x: nnx.merge(graphdef, st).hidden_states(x),
                in_shardings=(sharding.model_shardings(state, mesh), repl), out_shardings=repl)
  if not with_rules:
    return fwd.lower(state, ids)
  with sharding.activation_sharding(mesh):
    return fwd.lower(state, ids)


def test_activation_constraints_split_the_residual_stream_by_batch():
  mesh = sharding.make_mesh(data=2, fsdp=4, tensor=1)
  ids = jnp.zeros((8, 12), jnp.int32)  # fed replicated: only the constraints split it
  per_device, whole = "f32[1,12,32]", "f32[8,12,32]"
  sharded = _lowered_hidden_states(mesh, ids, with_rules=True).compile().as_text()
  assert sharded.count(per_device) > 10
  plain = _lowered_hidden_states(mesh, ids, with_rules=False).compile().as_text()
  assert per_device not in plain and whole in plain
  x = jnp.ones((8, 12, 32))
  assert sharding.constrain(x, sharding.ACTIVATION_AXES) is x  # no context: identity
  with sharding.activation_sharding(mesh), pytest.raises(ValueError, match="do not match"):
    sharding.constrain(x, ("batch", "length"))


def test_maybe_initialize_distributed_is_noop_single_process():
  assert sharding.maybe_initialize_distributed(env={}) is False
  assert sharding.maybe_initialize_distributed(env={"SLURM_NTASKS": "1"}) is False


def test_mesh_for_hosts_puts_the_hosts_on_the_minus_one_axis():
  assert sharding.mesh_shape_for_hosts(-1, 8, 1, hosts=2) == {"data": 2, "fsdp": 8, "tensor": 1}
  assert sharding.mesh_shape_for_hosts(1, 4, 2, hosts=3) == {"data": 1, "fsdp": 4, "tensor": 2}
  with pytest.raises(ValueError, match="hosts"):
    sharding.mesh_shape_for_hosts(-1, 8, 1, hosts=0)


def test_batch_divisibility_names_each_batch_that_would_lose_an_axis():
  mesh = {"data": 2, "fsdp": 8, "tensor": 1}
  batches = {"config.sft.global_batch_size / config.sft.micro_batches": 8, "whole batch": 32}
  problems = sharding.batch_divisibility_problems(mesh, sharding.DEFAULT_RULES, batches)
  assert len(problems) == 1
  assert problems[0].startswith("config.sft.global_batch_size / config.sft.micro_batches = 8 rows")
  assert "16 devices" in problems[0] and "data=2 x fsdp=8" in problems[0]
  # The `batch` rule's own axes count too: a batch over tensor as well needs 32 rows.
  rules = (("batch", ("data", "fsdp", "tensor")),) + sharding.DEFAULT_RULES
  wide = {"data": 2, "fsdp": 8, "tensor": 2}
  assert sharding.batch_divisibility_problems(wide, rules, {"b": 16}) != []
  assert sharding.batch_divisibility_problems(wide, rules, {"b": 32}) == []
  # ...which is exactly the axis logical_to_spec would drop silently.
  assert sharding.logical_to_spec(("batch",), sharding.DEFAULT_RULES, shape=(8,),
                                  mesh=_FakeMesh(mesh)) == jax.sharding.PartitionSpec("data")


class _FakeMesh:
  def __init__(self, shape):
    self.shape = shape
