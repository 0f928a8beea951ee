"""ModelConfig from HF config.json dicts: nesting, defaults, dtypes, clear errors."""

import jax.numpy as jnp
import pytest

from bat_jax.model import ModelConfig
from hf_fixtures import qwen3_5_multimodal_config, qwen3_5_text_config, qwen3_config


def test_multimodal_config_reads_nested_text_config():
  cfg = ModelConfig.from_hf_dict(qwen3_5_multimodal_config(hidden_size=48),
                                 dtype="bfloat16", param_dtype="float32")
  assert cfg.model_type == "qwen3_5" and cfg.is_multimodal_layout and cfg.is_hybrid
  assert cfg.hidden_size == 48 and cfg.rotary_dim == 4  # 16 * 0.25
  assert cfg.dtype == jnp.bfloat16 and cfg.param_dtype == jnp.float32
  assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg.replace(dtype=jnp.float32)


def test_defaults_and_legacy_rope_fields():
  d = qwen3_5_text_config(num_hidden_layers=8)
  del d["rope_parameters"]
  d.update(rope_theta=5e6, partial_rotary_factor=0.5)
  cfg = ModelConfig.from_hf_dict(d)
  # HF default: every 4th layer is full attention.
  assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
      "linear_attention",) * 3 + ("full_attention",)
  assert cfg.rope_theta == 5e6 and cfg.partial_rotary_factor == 0.5
  q3 = ModelConfig.from_hf_dict(qwen3_config(num_hidden_layers=3))
  assert q3.layer_types == ("full_attention",) * 3 and q3.partial_rotary_factor == 1.0
  assert not q3.attn_output_gate and not q3.zero_centered_norm
  assert ModelConfig.from_hf_dict(q3.to_hf_dict()) == q3


@pytest.mark.parametrize("edit, error, match", [
    (lambda d: d.update(model_type="llama"), ValueError, "unsupported model_type 'llama'"),
    (lambda d: d.pop("vocab_size"), KeyError, "'vocab_size'"),
    (lambda d: d.update(layer_types=["full_attention"]), ValueError, "layer_types has 1"),
    (lambda d: d.update(layer_types=["full_attention", "mamba"]), ValueError, r"layer_types\[1\]"),
    (lambda d: d.update(rope_parameters={"rope_type": "yarn"}), ValueError, "'yarn'"),
    (lambda d: d.update(hidden_act="gelu"), ValueError, "'hidden_act'"),
    (lambda d: d.update(num_key_value_heads=3), ValueError, "num_key_value_heads"),
])
def test_bad_config_errors_name_the_field(edit, error, match):
  d = qwen3_config()
  edit(d)
  with pytest.raises(error, match=match):
    ModelConfig.from_hf_dict(d)


def test_multimodal_without_text_config_is_rejected():
  with pytest.raises(ValueError, match="'text_config'"):
    ModelConfig.from_hf_dict({"model_type": "qwen3_5"})
