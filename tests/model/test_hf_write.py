"""The export's write half: shards -> HF layout in one pass, our safetensors writer, durability.

The writer's files are read back by safetensors itself (and by our loader), sync exports
(`durable=False`) call no fsync yet are complete and load, durable ones fsync, and files written
on several threads are byte-identical to the one-thread export.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file

from bat_jax import sharding
from bat_jax.model import ModelConfig, build_model, load_pretrained, save_pretrained
from bat_jax.model import hf_write
from hf_fixtures import qwen3_5_text_config

BF16 = np.dtype(ml_dtypes.bfloat16)


def _tensors() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {"a.weight": rng.standard_normal((5, 3)).astype(BF16),  # odd bytes: alignment
          "b.weight": rng.standard_normal((7,)).astype(np.float32),
          "c.ids": np.arange(3, dtype=np.int64), "d.mask": np.array([True, False]),
          "e.empty": np.zeros((0, 4), np.float32),
          "f.view": rng.standard_normal((4, 6)).astype(np.float32)[:, ::2]}  # not contiguous


def test_written_file_reads_back_equal_through_safetensors(tmp_path):
  tensors = _tensors()
  n = hf_write.write_safetensors(tmp_path / "m.safetensors", tensors, metadata={"format": "pt"})
  assert n == (tmp_path / "m.safetensors").stat().st_size
  back = load_file(tmp_path / "m.safetensors")
  assert back.keys() == tensors.keys()
  for k, v in tensors.items():
    assert back[k].dtype == v.dtype and back[k].shape == v.shape
    np.testing.assert_array_equal(back[k], v)
  with safe_open(tmp_path / "m.safetensors", framework="numpy") as f:
    assert f.metadata() == {"format": "pt"}
  header_len = int.from_bytes((tmp_path / "m.safetensors").read_bytes()[:8], "little")
  assert header_len % 8 == 0
  header = json.loads((tmp_path / "m.safetensors").read_bytes()[8:8 + header_len])
  for k, v in tensors.items():  # each tensor aligned to its item size
    assert header[k]["data_offsets"][0] % v.dtype.itemsize == 0
  assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no tmp left


def test_unsupported_dtype_is_named(tmp_path):
  with pytest.raises(ValueError, match="tensor 'x' has dtype complex64"):
    hf_write.write_safetensors(tmp_path / "m.safetensors", {"x": np.zeros(2, np.complex64)})
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spec", [P("fsdp", None), P(None, "fsdp"), P(None, None)])
def test_fetch_casts_and_transposes_each_shard_into_place(spec):
  mesh = sharding.make_mesh(1, 8, 1)
  host = np.random.default_rng(1).standard_normal((3, 16, 24)).astype(np.float32)
  value = jax.device_put(host, NamedSharding(mesh, P(None, *spec)))
  np.testing.assert_array_equal(hf_write.fetch_hf_layout(value, BF16),
                                host.astype(BF16))
  got = hf_write.fetch_hf_layout(value, BF16, transpose=True)
  assert got.shape == (3, 24, 16) and got.flags.c_contiguous
  np.testing.assert_array_equal(got, np.swapaxes(host, 1, 2).astype(BF16))


def _model(scan: bool = True):
  cfg = ModelConfig.from_hf_dict(qwen3_5_text_config(), param_dtype=jnp.float32)
  return build_model(cfg.replace(scan_layers=scan), rngs=nnx.Rngs(0))


def _count_fsyncs(monkeypatch) -> list:
  calls = []
  real = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
  return calls


@pytest.mark.parametrize("scan", [True, False])
def test_sync_export_calls_no_fsync_and_loads_complete(tmp_path, monkeypatch, scan):
  model = _model(scan)
  calls = _count_fsyncs(monkeypatch)
  stats = {}
  save_pretrained(model, tmp_path / "sync", dtype="bfloat16", durable=False, write_threads=3,
                  max_shard_bytes=4096, stats=stats)
  assert calls == []
  assert len(list((tmp_path / "sync").glob("model-*-of-*.safetensors"))) >= 3
  loaded = load_pretrained(tmp_path / "sync", scan_layers=scan)
  want = jax.tree.leaves(nnx.state(model, nnx.Param))
  got = jax.tree.leaves(nnx.state(loaded, nnx.Param))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, np.asarray(w).astype(BF16).astype(np.float32))
  assert stats["bytes_fetched"] == sum(w.size for w in want) * 4  # fp32 off the devices
  assert stats["bytes_written"] > stats["bytes_fetched"] // 2 and stats["fsync_s"] == 0
  save_pretrained(model, tmp_path / "durable", dtype="bfloat16", max_shard_bytes=4096)
  assert len(calls) > 3  # every file, the folder, config.json
  for f in sorted((tmp_path / "durable").iterdir()):  # threads change nothing on disk
    assert (tmp_path / "sync" / f.name).read_bytes() == f.read_bytes(), f.name


def test_bad_write_threads_is_named(tmp_path):
  with pytest.raises(ValueError, match="write_threads must be an int >= 1, got 0"):
    save_pretrained(_model(), tmp_path, write_threads=0)
