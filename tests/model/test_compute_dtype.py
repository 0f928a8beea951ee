"""bf16 compute on fp32 master weights: casts on the shards, bf16 logprob matmul, fp32 accumulation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax import sharding
from bat_jax.grpo.logprobs import chunked_logprobs
from bat_jax.model import ModelConfig, build_model
from hf_fixtures import qwen3_config


def test_bf16_param_casts_are_pinned_to_param_shardings():
  cfg = ModelConfig.from_hf_dict(qwen3_config(num_hidden_layers=2), dtype="bfloat16")
  assert cfg.param_dtype == jnp.float32
  graphdef, state = nnx.split(build_model(cfg, rngs=nnx.Rngs(0)))
  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  fwd = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x),
                in_shardings=(sharding.model_shardings(state, mesh), sharding.batch_sharding(mesh, 2)))
  with sharding.activation_sharding(mesh):
    text = fwd.lower(state, jnp.zeros((4, 8), jnp.int32)).as_text()
  pinned = re.findall(r"sdy\.sharding_constraint %\S+ <@mesh, \[([^\]]*)\]> : tensor<(\d+)x(\d+)x(\w+)>",
                      text)
  casts = [(spec, (int(a), int(b))) for spec, a, b, dt in pinned if dt == "bf16"]
  # One scanned layer body: q, k, v, o, gate, up, down kernels, plus the [V, D] unembedding.
  kernel_shapes = {(32, 32), (32, 16), (32, 48), (48, 32), (97, 32)}
  assert kernel_shapes <= {shape for _, shape in casts}
  assert all('"fsdp"' in spec for spec, shape in casts if shape in kernel_shapes)
  assert not any(dt == "f32" and (int(a), int(b)) in kernel_shapes for _, a, b, dt in pinned)


def test_chunked_logprobs_matmul_in_compute_dtype_with_fp32_accumulation():
  rng = np.random.RandomState(0)
  hidden = jnp.asarray(rng.normal(size=(2, 10, 16)), jnp.bfloat16)
  kernel = jnp.asarray(rng.normal(size=(16, 40)) * 0.3, jnp.float32)  # fp32 master
  targets = jnp.asarray(rng.randint(0, 40, (2, 10)), jnp.int32)
  jaxpr = str(jax.make_jaxpr(lambda h, k: chunked_logprobs(h, k, targets, chunk_size=4))(
      hidden, kernel))
  assert jaxpr.count("dot_general[") == 1 and "preferred_element_type=float32" in jaxpr
  assert re.search(r"bf16\[16,40\] = convert_element_type", jaxpr)  # cast once, outside the scan
  logp, _ = chunked_logprobs(hidden, kernel, targets, chunk_size=4)
  logits = np.asarray(hidden, np.float32) @ np.asarray(kernel.astype(jnp.bfloat16), np.float32)
  expected = (np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
              - np.log(np.exp(logits).sum(-1)))
  assert logp.dtype == jnp.float32
  # Against the bf16-rounded table (fp32 table logits differ by ~1e-2 here).
  np.testing.assert_allclose(logp, expected, atol=1e-4)
