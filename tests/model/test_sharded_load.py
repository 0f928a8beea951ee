"""`load_pretrained(..., mesh=...)`: params assembled from per-device slices on 8 fake devices."""

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import jax

from bat_jax import sharding
from bat_jax.model import ModelConfig, build_model, hf_io, load_pretrained, save_pretrained
from hf_fixtures import qwen3_5_text_config

MIB = 2**20


@pytest.fixture(scope="module")
def saved_wide(tmp_path_factory):
  """8 layers (2 cycles), widths that divide an 8-way mesh; several leaves >= 1 MiB."""
  hf = qwen3_5_text_config(vocab_size=1024, hidden_size=256, intermediate_size=1024,
                           num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
                           linear_num_key_heads=4, linear_num_value_heads=8)
  model = build_model(ModelConfig.from_hf_dict(hf), rngs=nnx.Rngs(0))
  path = tmp_path_factory.mktemp("wide")
  save_pretrained(model, path)
  return path


def _flat(model):
  return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_sharded_load_places_big_leaves_on_shards(saved_wide, monkeypatch):
  reads = []
  read = hf_io._TensorReader.read
  def recording_read(self, name, leaf, index):
    out = read(self, name, leaf, index)
    reads.append((name, out.size))
    return out
  monkeypatch.setattr(hf_io._TensorReader, "read", recording_read)

  mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
  model = load_pretrained(saved_wide, mesh=mesh)
  sharded_reads = list(reads)
  plain = _flat(load_pretrained(saved_wide, scan_layers=True))
  big = 0
  for path, value in _flat(model).items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(plain[path]), err_msg=str(path))
    if value.nbytes >= MIB:
      big += 1
      assert len(value.sharding.device_set) == 8, path
      shard_bytes = {s.data.nbytes for s in value.addressable_shards}
      assert shard_bytes == {value.nbytes // 8}, (path, value.sharding.spec)
  assert big >= 4  # embedding, lm_head, stacked MLP kernels, DeltaNet qkv...
  # No read of a big per-layer tensor returned it whole: each device read its own slice.
  full = {n: t.size for n, t in load_file(saved_wide / "model.safetensors").items()}
  big_reads = [(n, size) for n, size in sharded_reads if full[n] * 4 >= MIB // 4]
  assert big_reads and all(size * 8 == full[n] for n, size in big_reads)


def test_export_from_sharded_params_matches_original_layout(saved_wide, tmp_path):
  model = load_pretrained(saved_wide, mesh=sharding.make_mesh(data=2, fsdp=2, tensor=2))
  save_pretrained(model, tmp_path)
  original = load_file(saved_wide / "model.safetensors")
  again = load_file(tmp_path / "model.safetensors")
  assert original.keys() == again.keys()
  for name in original:
    assert original[name].tobytes() == again[name].tobytes(), name


def test_unscanned_load_matches_scanned_layout(saved_wide):
  scanned = load_pretrained(saved_wide)
  flat = load_pretrained(saved_wide, scan_layers=False)
  cfg = scanned.config
  assert cfg.layer_cycle == 4 and cfg.num_cycles == 2
  kernel = scanned.layers[3].mlp.down_proj.kernel.get_value()
  assert kernel.shape == (2, 1024, 256)
  np.testing.assert_array_equal(kernel[1], flat.layers[7].mlp.down_proj.kernel.get_value())
  assert jax.tree.structure(hf_io.hf_state_dict(scanned)) == jax.tree.structure(
      hf_io.hf_state_dict(flat))
