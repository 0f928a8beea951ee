"""fp32 logit parity against transformers' PyTorch Qwen3 / Qwen3.5 models."""

import numpy as np
import pytest

import jax.numpy as jnp

from bat_jax.model import load_pretrained
from hf_fixtures import (build_torch_model, jit_call, qwen3_5_multimodal_config, qwen3_5_text_config,
                         qwen3_config, save_torch_model, torch_logits)

L, F = "linear_attention", "full_attention"

CASES = {
    # GQA 4:2, head_dim 8.
    "qwen3_gqa2": qwen3_config(),
    # MQA 4:1, head_dim 16 != hidden / heads, tied embeddings, 3 layers.
    "qwen3_mqa_tied": qwen3_config(num_key_value_heads=1, head_dim=16, num_hidden_layers=3,
                                   tie_word_embeddings=True),
    # Hybrid L L L F, partial rotary 0.25, DeltaNet with 2 k heads : 4 v heads.
    "qwen3_5_lllf": qwen3_5_text_config(),
    # F L F L, partial rotary 0.5, MHA 4:4, DeltaNet 1 k head : 2 v heads, Dk != Dv.
    "qwen3_5_flfl": qwen3_5_text_config(
        layer_types=[F, L, F, L], num_key_value_heads=4, head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=3),
    # Multimodal checkpoint layout (model.language_model.*, vision tower skipped), tied.
    "qwen3_5_vlm_tied": qwen3_5_multimodal_config(num_hidden_layers=2, layer_types=[L, F],
                                                  tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers_fp32(name, tmp_path, caplog):
  torch_model = build_torch_model(CASES[name], seed=len(name))
  save_torch_model(torch_model, tmp_path)
  with caplog.at_level("INFO"):
    model = load_pretrained(tmp_path)
  if name.startswith("qwen3_5_vlm"):
    assert "skipping" in caplog.text and "visual" in caplog.text
  # 70 tokens: more than one 64-token DeltaNet chunk, with a ragged tail.
  ids = np.random.RandomState(1).randint(0, 97, size=(2, 70))
  ref = torch_logits(torch_model, ids).numpy()
  out = np.asarray(jit_call(model, jnp.asarray(ids, jnp.int32)))
  assert out.shape == ref.shape == (2, 70, 97)
  assert np.abs(out - ref).max() < 1e-4
