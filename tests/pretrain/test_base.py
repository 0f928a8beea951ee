"""The tiny base: packed rows, a cached build keyed by its config, a leak check that fails
closed, and a resumed build that ends bit-identical."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from bat_jax import sharding
from bat_jax.model import ModelConfig, build_model
from bat_jax.model import tokenizer as tokenizer_lib
from bat_jax.pretrain import base

HF = {"model_type": "qwen3_5_text", "vocab_size": 600, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 2,
      "layer_types": ["full_attention", "linear_attention"], "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 1,
      "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
      "tie_word_embeddings": True}


class _Checker:
  def __init__(self, bad_index=None):
    self.bad_index, self.seen = bad_index, 0

  def check_row(self, row, index=0, pool=""):
    self.seen += 1
    assert pool == "pretrain" and isinstance(row["text"], str)
    return ["heldout_marker"] if index == self.bad_index else []


def _pcfg(tmp_path, **kw):
  fields = dict(steps=3, batch_size=2, seq_len=64, lr=1e-3, warmup_steps=1, seed=5, probes=4,
                checkpoint_every=1, cache_dir=str(tmp_path / "cache"))
  return base.PretrainConfig(**{**fields, **kw})


def _build():
  cfg = ModelConfig.from_hf_dict(HF, dtype="float32", param_dtype="float32")
  return build_model(cfg, rngs=nnx.Rngs(0))


def _ensure(pcfg, tokenizer_dir, checker=None):
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
  return base.ensure_base(_build, pcfg, HF, tokenizer_dir, checker or _Checker(), mesh=mesh,
                          rules=sharding.DEFAULT_RULES)


def test_packed_rows_carry_loss_only_on_calls(tokenizer_dir, tmp_path):
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
  pcfg = _pcfg(tmp_path, steps=4, seq_len=96)
  rows, n_docs = base.packed_rows(tokenizer, pcfg, eot_id=0)
  assert len(rows) == 4 * 2 and n_docs > 0
  assert all(len(ids) == len(mask) == 96 and mask[0] == 0 for ids, mask in rows)
  ids = [t for r, _ in rows for t in r]
  mask = [m for _, ms in rows for m in ms]
  called = tokenizer.decode([t for t, m in zip(ids, mask) if m])
  assert "python tools/" in called and "Facts:" not in called and "Usage:" not in called
  assert 0.1 < np.mean(mask) < 0.9
  assert rows == base.packed_rows(tokenizer, pcfg, eot_id=0)[0]   # deterministic


def test_build_then_cache_hit_and_key_follows_the_config(tokenizer_dir, tmp_path):
  pcfg = _pcfg(tmp_path)
  model_dir, record = _ensure(pcfg, tokenizer_dir)
  assert not record["cache_hit"] and record["steps"] == 3
  assert 0.0 <= record["copy_accuracy"] <= 1.0 and record["probes"] == 4
  assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
  assert not (model_dir.parent.with_name(model_dir.parent.name + ".build")).exists()
  checker = _Checker()
  again_dir, again = _ensure(pcfg, tokenizer_dir, checker)
  assert again_dir == model_dir and again["cache_hit"]
  assert {k: v for k, v in again.items() if k != "cache_hit"} == \
      {k: v for k, v in record.items() if k != "cache_hit"}
  assert checker.seen >= record["documents"]       # a reused base is leak-checked again
  key = base.cache_key(pcfg, HF, tokenizer_dir)
  assert key == model_dir.parent.name
  assert base.cache_key(dataclasses.replace(pcfg, cache_dir="/elsewhere"), HF,
                        tokenizer_dir) == key
  assert base.cache_key(dataclasses.replace(pcfg, lr=2e-3), HF, tokenizer_dir) != key
  assert base.cache_key(pcfg, {**HF, "hidden_size": 64}, tokenizer_dir) != key


def test_a_leaking_document_fails_closed(tokenizer_dir, tmp_path):
  with pytest.raises(ValueError, match="pretraining document 2 .*leak check"):
    _ensure(_pcfg(tmp_path), tokenizer_dir, _Checker(bad_index=2))
  assert not list((tmp_path / "cache").glob("*/base.json"))


def test_killed_build_resumes_bit_identical(tokenizer_dir, tmp_path, monkeypatch):
  whole_dir, _ = _ensure(_pcfg(tmp_path / "a"), tokenizer_dir)
  real_probe = base.probe_copy
  monkeypatch.setattr(base, "probe_copy", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
  with pytest.raises(KeyboardInterrupt):
    _ensure(_pcfg(tmp_path / "b"), tokenizer_dir)
  assert list((tmp_path / "b" / "cache").glob("*.build/ckpt"))
  monkeypatch.setattr(base, "probe_copy", real_probe)
  resumed_dir, record = _ensure(_pcfg(tmp_path / "b"), tokenizer_dir)
  read = lambda d: json.loads((d / "model.safetensors.index.json").read_text()) \
      if (d / "model.safetensors.index.json").is_file() else None
  from safetensors.numpy import load_file
  files = sorted(p.name for p in whole_dir.glob("*.safetensors"))
  assert files and files == sorted(p.name for p in resumed_dir.glob("*.safetensors"))
  assert read(whole_dir) == read(resumed_dir)
  for name in files:
    a, b = load_file(whole_dir / name), load_file(resumed_dir / name)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
