"""HF safetensors import / export: bit-identical round trips, sharding, transformers load."""

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import jax
import jax.numpy as jnp
from flax import nnx

from bat_jax.model import ModelConfig, build_model, hf_state_dict, load_pretrained, save_pretrained
from hf_fixtures import (build_torch_model, jit_call, qwen3_5_multimodal_config,
                         qwen3_5_text_config, qwen3_config, save_torch_model)


def _params(model):
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_bit_identical(a: dict, b: dict):
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert a[k].tobytes() == b[k].tobytes(), k


def _read_checkpoint(path) -> dict:
  index = path / "model.safetensors.index.json"
  if not index.exists():
    return load_file(path / "model.safetensors")
  out = {}
  for fname in sorted(set(json.loads(index.read_text())["weight_map"].values())):
    out.update(load_file(path / fname))
  return out


def test_hf_import_export_import_is_bit_identical_with_sharded_index(tmp_path):
  torch_model = build_torch_model(qwen3_5_text_config(), seed=3)
  # transformers writes a sharded checkpoint + index when max_shard_size is small.
  save_torch_model(torch_model, tmp_path / "hf", max_shard_size="20KB")
  assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
  original = _read_checkpoint(tmp_path / "hf")

  first = load_pretrained(tmp_path / "hf")
  save_pretrained(first, tmp_path / "single")
  save_pretrained(first, tmp_path / "sharded", max_shard_bytes=16_000)
  index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  assert not (tmp_path / "sharded" / "model.safetensors").exists()

  # Export reproduces the original HF tensors byte for byte, in both layouts.
  _assert_bit_identical(original, _read_checkpoint(tmp_path / "single"))
  _assert_bit_identical(original, _read_checkpoint(tmp_path / "sharded"))
  # Re-import gives bit-identical params.
  _assert_bit_identical(_params(first), _params(load_pretrained(tmp_path / "sharded")))
  _assert_bit_identical(_params(first), _params(load_pretrained(tmp_path / "single")))


def test_export_loads_in_transformers_with_same_logits(tmp_path):
  # The hardest layout: multimodal Qwen3.5 with tied embeddings (no vision weights).
  cfg = ModelConfig.from_hf_dict(qwen3_5_multimodal_config(
      num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
      tie_word_embeddings=True))
  model = build_model(cfg, rngs=nnx.Rngs(7))
  # Non-trivial norm weights so a norm-convention mismatch would show.
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if path[-1] == "weight":
      var[...] = var[...] + 0.1 * jax.random.normal(jax.random.key(len(path)), var.shape)
  tok_dir = tmp_path / "tok"
  tok_dir.mkdir()
  (tok_dir / "tokenizer_config.json").write_text('{"model_max_length": 64}')
  save_pretrained(model, tmp_path / "out", tokenizer_dir=tok_dir)
  assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'

  names = set(_read_checkpoint(tmp_path / "out"))
  assert all(n.startswith("model.language_model.") for n in names)
  hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "out")
  ids = np.random.RandomState(0).randint(0, cfg.vocab_size, size=(2, 9))
  with torch.no_grad():
    ref = hf.float().eval()(input_ids=torch.as_tensor(ids)).logits.numpy()
  out = np.asarray(jit_call(model, jnp.asarray(ids, jnp.int32)))
  assert np.abs(out - ref).max() < 1e-4


def test_bf16_params_round_trip(tmp_path):
  cfg = ModelConfig.from_hf_dict(qwen3_config(), param_dtype="bfloat16", dtype="bfloat16")
  model = build_model(cfg, rngs=nnx.Rngs(0))
  save_pretrained(model, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  tensors = load_file(tmp_path / "model.safetensors")
  assert all(t.dtype == jnp.bfloat16 for t in tensors.values())
  again = load_pretrained(tmp_path, param_dtype="bfloat16", dtype="bfloat16")
  _assert_bit_identical(_params(model), _params(again))
  assert hf_state_dict(again).keys() == tensors.keys()


# -- bad input: every error names the key / file at fault ----------------------


@pytest.fixture
def saved_qwen3(tmp_path):
  model = build_model(ModelConfig.from_hf_dict(qwen3_config()), rngs=nnx.Rngs(0))
  save_pretrained(model, tmp_path)
  return tmp_path


def _edit_weights(path, fn):
  tensors = load_file(path / "model.safetensors")
  fn(tensors)
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_weight_names_key(saved_qwen3):
  _edit_weights(saved_qwen3, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(KeyError, match=r"missing weights.*model\.layers\.1\.mlp\.up_proj\.weight"):
    load_pretrained(saved_qwen3)


def test_unexpected_weight_names_key_and_file(saved_qwen3):
  _edit_weights(saved_qwen3, lambda t: t.update({"model.layers.0.extra.weight": np.ones(3)}))
  with pytest.raises(KeyError, match=r"model\.safetensors.*model\.layers\.0\.extra\.weight"):
    load_pretrained(saved_qwen3)


def test_shape_mismatch_names_key(saved_qwen3):
  def shrink(t):
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:4]
  _edit_weights(saved_qwen3, shrink)
  with pytest.raises(ValueError, match=r"shape mismatch.*self_attn\.k_proj\.weight.*\(4, 32\)"):
    load_pretrained(saved_qwen3)


def test_unsupported_model_type_names_it(saved_qwen3):
  cfg = json.loads((saved_qwen3 / "config.json").read_text())
  (saved_qwen3 / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
  with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
    load_pretrained(saved_qwen3)


def test_missing_files_are_named(saved_qwen3):
  (saved_qwen3 / "model.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
    load_pretrained(saved_qwen3)
  (saved_qwen3 / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
  with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
    load_pretrained(saved_qwen3)
  (saved_qwen3 / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match=r"config\.json"):
    load_pretrained(saved_qwen3)
  with pytest.raises(FileNotFoundError, match="no_such_tokenizer"):
    save_pretrained(build_model(ModelConfig.from_hf_dict(qwen3_config()), rngs=nnx.Rngs(0)),
                    saved_qwen3, tokenizer_dir=saved_qwen3 / "no_such_tokenizer")


def test_multimodal_export_carries_the_vision_tower_and_preprocessor(tmp_path):
  """SGLang 0.5.23 serves Qwen3.5 only as `Qwen3_5ForConditionalGeneration` (the EntryClass of
  python/sglang/srt/models/qwen3_5.py), which builds the vision tower and its processor: the
  export must carry both, or the multimodal architecture it declares does not load."""
  from bat_jax.checkpointing import export_hf
  hf = qwen3_5_multimodal_config(num_hidden_layers=2,
                                 layer_types=["linear_attention", "full_attention"])
  src = save_torch_model(build_torch_model(hf, seed=3), tmp_path / "src")
  (src / "preprocessor_config.json").write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(1, 8, 1),
                           ("data", "fsdp", "tensor"))
  model = load_pretrained(src, mesh=mesh)  # the language model only, on its shards
  out = export_hf(model, tmp_path / "out", dtype="bfloat16", vision_source=src,
                  max_shard_bytes=20_000)
  source, exported = _read_checkpoint(src), _read_checkpoint(out)
  visual = sorted(n for n in source if n.startswith("model.visual."))
  assert visual and set(visual) <= set(exported)
  for name in visual:
    assert exported[name].dtype == jnp.bfloat16
    np.testing.assert_array_equal(exported[name], source[name].astype(jnp.bfloat16), name)
  assert (out / "model.safetensors.index.json").is_file()
  assert (out / "preprocessor_config.json").read_text() == (
      src / "preprocessor_config.json").read_text()
  written = json.loads((out / "config.json").read_text())
  assert written["architectures"] == ["Qwen3_5ForConditionalGeneration"]
  assert written["vision_config"]["depth"] == 1 and written["dtype"] == "bfloat16"
  # A multimodal loader finds every weight it builds (the vision tower included).
  _, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
      out, output_loading_info=True)
  assert not info["missing_keys"], info["missing_keys"]
  assert not info["unexpected_keys"], info["unexpected_keys"]


def test_vision_source_without_a_tower_or_for_a_text_model_is_refused(tmp_path):
  text = build_model(ModelConfig.from_hf_dict(qwen3_5_text_config()), rngs=nnx.Rngs(0))
  save_pretrained(text, tmp_path / "text")
  (tmp_path / "text" / "preprocessor_config.json").write_text("{}")
  with pytest.raises(ValueError, match=r"holds no model.visual.\* tensors"):
    save_pretrained(text, tmp_path / "out", vision_source=tmp_path / "text")
