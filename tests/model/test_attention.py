"""Attention kernels: chunked (blockwise online softmax) == dense, in values,
gradients and whole-model parity; chunked uses less compiled temp memory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bat_jax import sharding
from bat_jax.model import ModelConfig, build_model, load_pretrained
from bat_jax.model.attention import (AttentionMask, attend, attend_cached,
                                     causal_block_attention, resolve_impl)
from bat_jax.model.decoder import with_attention_impl
from bat_jax.model.layers import Attention
from hf_fixtures import (build_torch_model, jit_call, qwen3_5_text_config, qwen3_config,
                         save_torch_model, torch_logits)


def reference_attention(q, k, v, mask: AttentionMask):
  """Straightforward dense GQA softmax attention (fp32), the oracle."""
  b, t, h, dh = q.shape
  kv = k.shape[2]
  qg = q.reshape(b, t, kv, h // kv, dh) * dh ** -0.5
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k)
  logits = jnp.where(mask.dense()[:, None, None], logits, -1e30)
  out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(logits, axis=-1), v)
  return out.reshape(b, t, h, dh)


def _qkv(b, t, s, h, kv, dh, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, t, h, dh)), jax.random.normal(keys[1], (b, s, kv, dh)),
          jax.random.normal(keys[2], (b, s, kv, dh)))


def _check_against_reference(q, k, v, mask, query_ok, impls):
  """Forward and d(weighted sum over visible query rows)/d(q, k, v) agree."""
  w = jax.random.normal(jax.random.key(7), q.shape) * query_ok[:, :, None, None]

  def run(fn):
    def loss(q, k, v):
      out = fn(q, k, v)
      return jnp.sum(out * w), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return out, grads

  ok = np.asarray(query_ok)
  ref_out, ref_grads = run(lambda q, k, v: reference_attention(q, k, v, mask))
  for impl, kwargs in impls:
    out, grads = run(lambda q, k, v: attend(q, k, v, mask, impl=impl, **kwargs))
    assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(np.asarray(out)[ok], np.asarray(ref_out)[ok], atol=1e-5,
                               err_msg=f"{impl} forward")
    for name, g, rg in zip("qkv", grads, ref_grads):
      assert bool(jnp.all(jnp.isfinite(g))), f"{impl} d{name} not finite"
      np.testing.assert_allclose(g, rg, atol=1e-5, err_msg=f"{impl} d{name}")


def test_causal_chunked_matches_dense_with_gqa_and_right_padding():
  # T = 37: not a multiple of the block, so the last query / key block is padded.
  q, k, v = _qkv(3, 37, 37, 4, 2, 8)
  lens = jnp.asarray([37, 20, 1])
  valid = jnp.arange(37)[None, :] < lens[:, None]
  mask = AttentionMask.causal(valid)
  _check_against_reference(q, k, v, mask, valid, [
      ("xla", {}), ("chunked", dict(block_size=8))])


@pytest.mark.parametrize("t,num_blocks", [(100, 8), (64, 3), (16, 8), (256, 1)])
def test_causal_block_attention_matches_dense(t, num_blocks):
  # Query blocks of >= 16 rows, the last one short when t does not divide; a fully padded
  # row stays finite (its values are not used).
  q, k, v = _qkv(3, t, t, 8, 2, 8, seed=t)
  lens = jnp.asarray([t, t // 3, 0])
  valid = jnp.arange(t)[None, :] < lens[:, None]
  mask = AttentionMask.causal(valid)
  out = causal_block_attention(q, k, v, valid, scale=8 ** -0.5, num_blocks=num_blocks)
  assert bool(jnp.all(jnp.isfinite(out)))
  ok = np.asarray(valid)
  expected = np.asarray(reference_attention(q, k, v, mask))
  np.testing.assert_allclose(np.asarray(out)[ok], expected[ok], atol=1e-5)


def test_cache_mask_chunked_matches_dense_with_ragged_lengths():
  # 5 new tokens per row written after ragged cache contents into 24 slots;
  # row 2 has only 2 valid new tokens (its padded queries reuse slot 12).
  b, t, s = 3, 5, 24
  q, k, v = _qkv(b, t, s, 4, 1, 8, seed=1)  # MQA
  start = jnp.asarray([0, 9, 11])
  n_valid = jnp.asarray([5, 5, 2])
  counts = jnp.minimum(jnp.arange(1, t + 1)[None, :], n_valid[:, None])
  slots = start[:, None] + counts - 1
  mask = AttentionMask.for_cache(slots, start + n_valid, s)
  assert not mask.aligned
  query_ok = jnp.arange(t)[None, :] < n_valid[:, None]
  _check_against_reference(q, k, v, mask, query_ok, [
      ("xla", {}), ("chunked", dict(block_size=4))])


@pytest.mark.parametrize("impl", ["xla", "chunked"])
@pytest.mark.parametrize("t", [1, 5])
def test_attention_over_the_cache_layout_matches_dense(impl, t):
  """`attend_cached` reads key [B, K, Dh, S] / value [B, K, S, Dh] (the `KVCache` layout) and
  equals the dense oracle on the same keys, decode (t = 1) and prefill chunks, with GQA
  (4 query heads on 2 kv heads: a wrong group fold would pair a query with the wrong head)."""
  b, s = 3, 24
  q, k, v = _qkv(b, t, s, 4, 2, 8, seed=3 + t)
  start = jnp.asarray([0, 9, 18])
  n_valid = jnp.asarray([t, max(t - 2, 1), t])
  counts = jnp.minimum(jnp.arange(1, t + 1)[None, :], n_valid[:, None])
  slots = start[:, None] + counts - 1
  mask = AttentionMask.for_cache(slots, start + n_valid, s)
  query_ok = np.asarray(jnp.arange(t)[None, :] < n_valid[:, None])
  out = jax.jit(lambda q, kt, v: attend_cached(q, kt, v, mask, impl=impl, block_size=8))(
      q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))
  assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out)))
  expected = np.asarray(reference_attention(q, k, v, mask))
  np.testing.assert_allclose(np.asarray(out)[query_ok], expected[query_ok], atol=1e-5)


def test_chunked_keeps_fully_masked_rows_finite():
  q, k, v = _qkv(1, 8, 8, 2, 2, 4, seed=2)
  mask = AttentionMask.causal(jnp.zeros((1, 8), bool))  # a fully padded row
  out, grads = jax.jit(jax.value_and_grad(
      lambda q: jnp.sum(attend(q, k, v, mask, impl="chunked", block_size=4))))(q)
  assert bool(jnp.all(jnp.isfinite(out))) and bool(jnp.all(jnp.isfinite(grads)))


def test_resolve_impl_rules_and_errors():
  causal = AttentionMask.causal(jnp.ones((1, 8), bool))
  cached = AttentionMask.for_cache(jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), 8)
  kw = dict(dtype=jnp.float32)
  assert resolve_impl("chunked", q_len=8, kv_len=8, mask=causal, **kw) == "chunked"
  assert resolve_impl("cudnn", q_len=8, kv_len=8, mask=causal, **kw) == "cudnn"
  # cuDNN cannot express per-row cache offsets: automatic choice instead.
  assert resolve_impl("cudnn", q_len=1, kv_len=8, mask=cached, **kw) == "xla"
  assert resolve_impl("cudnn", q_len=4096, kv_len=4096, mask=cached, **kw) == "chunked"
  if jax.default_backend() != "gpu":
    assert resolve_impl(None, q_len=64, kv_len=64, mask=causal, **kw) == "xla"
    assert resolve_impl(None, q_len=4096, kv_len=4096, mask=causal, **kw) == "chunked"
  with pytest.raises(ValueError, match="'flash'"):
    resolve_impl("flash", q_len=8, kv_len=8, mask=causal, **kw)
  with pytest.raises(ValueError, match="attention_impl 'flash'"):
    ModelConfig.from_hf_dict(qwen3_config()).replace(attention_impl="flash")
  with pytest.raises(ValueError, match="attention_block_size"):
    ModelConfig.from_hf_dict(qwen3_config()).replace(attention_block_size=0)


@pytest.fixture(scope="module")
def torch_reference(tmp_path_factory):
  """Saved HF models + reference logits for a 70-token ragged batch."""
  out = {}
  ids = np.random.RandomState(1).randint(0, 97, size=(2, 70))
  for name, hf in {"qwen3": qwen3_config(), "qwen3_5": qwen3_5_text_config()}.items():
    torch_model = build_torch_model(hf, seed=3)
    path = save_torch_model(torch_model, tmp_path_factory.mktemp(name))
    out[name] = (path, ids, torch_logits(torch_model, ids).numpy())
  return out


@pytest.mark.parametrize("impl", ["xla", "chunked"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_model_logits_match_transformers_with_each_impl(torch_reference, family, impl):
  path, ids, ref = torch_reference[family]
  model = with_attention_impl(load_pretrained(path), impl, block_size=16)
  attentions = [m for _, m in model.iter_modules() if isinstance(m, Attention)]
  assert attentions and all(m.attention_impl == impl for m in attentions)
  out = np.asarray(jit_call(model, jnp.asarray(ids, jnp.int32)))
  assert np.abs(out - ref).max() < 1e-4


def test_chunked_prefill_and_decode_equal_full_forward():
  cfg = ModelConfig.from_hf_dict(qwen3_config()).replace(attention_impl="chunked",
                                                         attention_block_size=4)
  model = build_model(cfg, rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.RandomState(0).randint(0, 97, size=(2, 14)), jnp.int32)
  full = jit_call(with_attention_impl(model, "xla"), ids)
  lens = np.array([9, 3])
  valid = jnp.arange(10)[None, :] < lens[:, None]
  logits, cache = jit_call(model, jnp.where(valid, ids[:, :10], 5), cache=model.init_cache(2, 16),
                           valid=valid)
  for b, n in enumerate(lens):
    np.testing.assert_allclose(logits[b, :n], full[b, :n], atol=1e-5)
  for step in range(3):
    nxt = jnp.asarray([[ids[b, n + step]] for b, n in enumerate(lens)])
    logits, cache = jit_call(model, nxt, cache=cache, valid=jnp.ones((2, 1), bool))
    for b, n in enumerate(lens):
      np.testing.assert_allclose(logits[b, 0], full[b, n + step], atol=1e-5)


def fwd_bwd_temp_bytes(cfg: ModelConfig, batch: int, seq: int) -> int:
  """XLA temp allocation of one compiled loss+grad step (nothing executed)."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))),
                               nnx.Param)

  def step(params, ids):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p)(ids[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    return jax.value_and_grad(loss_fn)(params)

  ids = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
  compiled = jax.jit(step).lower(params, ids).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_forward_backward_needs_less_temp_memory():
  cfg = ModelConfig.from_hf_dict(qwen3_config(
      vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
      num_key_value_heads=2, head_dim=8, max_position_embeddings=4096))
  dense = fwd_bwd_temp_bytes(cfg.replace(attention_impl="xla"), 1, 768)
  chunked = fwd_bwd_temp_bytes(cfg.replace(attention_impl="chunked", attention_block_size=64),
                               1, 768)
  # Dense holds [B, H, T, T] fp32 logits / probabilities (18 MiB each here).
  assert dense > 18 * 2**20
  assert chunked < dense / 4


@pytest.mark.gpu
def test_cudnn_flash_attention_matches_chunked_on_gpu():
  """bf16 cuDNN flash attention (what `attention_impl=None` picks on GPU for
  cache-free chunks) agrees with the chunked kernel, values and gradients."""
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(2, 256, 256, 8, 2, 64, seed=4))
  valid = jnp.arange(256)[None, :] < jnp.asarray([256, 100])[:, None]
  mask = AttentionMask.causal(valid)
  assert resolve_impl(None, q_len=256, kv_len=256, mask=mask, dtype=jnp.bfloat16) == "cudnn"
  w = valid[:, :, None, None].astype(jnp.bfloat16)

  def grads(impl):
    loss = lambda q, k, v: jnp.sum((attend(q, k, v, mask, impl=impl) * w).astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)

  (cudnn_loss, cudnn_grads), (ref_loss, ref_grads) = grads("cudnn"), grads("chunked")
  np.testing.assert_allclose(cudnn_loss, ref_loss, rtol=2e-2)
  for g, rg in zip(cudnn_grads, ref_grads):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(rg, np.float32), atol=5e-2)


def test_chunked_forward_sharded_over_8_devices_equals_unsharded_dense():
  cfg = ModelConfig.from_hf_dict(qwen3_config())
  model = build_model(cfg.replace(attention_impl="chunked", attention_block_size=4),
                      rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.RandomState(0).randint(0, 97, size=(4, 12)), jnp.int32)
  expected = jit_call(with_attention_impl(model, "xla"), ids)
  graphdef, state = nnx.split(model)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])
  param_sh = sharding.model_shardings(state, mesh)
  batch_sh = sharding.batch_sharding(mesh, 2)
  forward = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x), in_shardings=(param_sh, batch_sh),
                    out_shardings=sharding.batch_sharding(mesh, 3))
  with jax.default_matmul_precision("highest"):
    out = forward(jax.device_put(state, param_sh), jax.device_put(ids, batch_sh))
  np.testing.assert_allclose(out, expected, atol=1e-5)


class _FakeGpu:
  platform, device_kind = "gpu", "fake"

  def __init__(self, capability: str):
    self.compute_capability = capability


def test_cudnn_head_dim_limit_follows_compute_capability():
  from bat_jax.model.attention import cudnn_max_head_dim
  assert cudnn_max_head_dim(_FakeGpu("9.0")) == 256    # Hopper: head_dim 256 ok
  assert cudnn_max_head_dim(_FakeGpu("10.0")) == 256
  assert cudnn_max_head_dim(_FakeGpu("8.0")) == 128    # A100: 256 rejected by cuDNN
  assert cudnn_max_head_dim(_FakeGpu("7.5")) == 0
  assert cudnn_max_head_dim(_FakeGpu("gfx90a")) == 0   # ROCm: no cuDNN
  assert cudnn_max_head_dim(jax.devices("cpu")[0]) == 0


def test_query_block_count_from_the_environment_is_checked(monkeypatch):
  from bat_jax.model.attention import _query_blocks_from_env
  monkeypatch.setenv("BAT_JAX_CAUSAL_QUERY_BLOCKS", "4")
  assert _query_blocks_from_env() == 4
  for bad in ("0", "two", "-3"):
    monkeypatch.setenv("BAT_JAX_CAUSAL_QUERY_BLOCKS", bad)
    with pytest.raises(ValueError, match="BAT_JAX_CAUSAL_QUERY_BLOCKS"):
      _query_blocks_from_env()
