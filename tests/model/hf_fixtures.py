"""Tiny random transformers (PyTorch) reference models saved as HF checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import torch
from flax import nnx
import transformers


def qwen3_config(**overrides: Any) -> dict[str, Any]:
  cfg = dict(model_type="qwen3", vocab_size=97, hidden_size=32, intermediate_size=48,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             max_position_embeddings=256, tie_word_embeddings=False)
  cfg.update(overrides)
  return cfg


def qwen3_5_text_config(**overrides: Any) -> dict[str, Any]:
  cfg = dict(model_type="qwen3_5_text", vocab_size=97, hidden_size=32, intermediate_size=48,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             layer_types=["linear_attention", "linear_attention", "linear_attention",
                          "full_attention"],
             rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.25},
             linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=4,
             max_position_embeddings=256, tie_word_embeddings=False)
  cfg.update(overrides)
  if "num_hidden_layers" in overrides and "layer_types" not in overrides:
    cfg.pop("layer_types")
  return cfg


def qwen3_5_multimodal_config(**text_overrides: Any) -> dict[str, Any]:
  text = qwen3_5_text_config(**text_overrides)
  vision = dict(model_type="qwen3_5_vision", depth=1, hidden_size=16, intermediate_size=32,
                num_heads=2, out_hidden_size=text["hidden_size"], patch_size=4,
                temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
  return dict(model_type="qwen3_5", text_config=text, vision_config=vision,
              tie_word_embeddings=text["tie_word_embeddings"],
              image_token_id=90, video_token_id=91, vision_start_token_id=92,
              vision_end_token_id=93)


def build_torch_model(hf_dict: dict[str, Any], seed: int = 0) -> torch.nn.Module:
  """A random fp32 transformers model; norm weights are randomised too so
  parity tests catch norm-convention mistakes (HF inits them to 0 / 1)."""
  torch.manual_seed(seed)
  d = dict(hf_dict)
  model_type = d.pop("model_type")
  config_cls = transformers.AutoConfig.for_model(model_type, **d)
  if model_type == "qwen3_5":
    model = transformers.Qwen3_5ForConditionalGeneration(config_cls)
  else:
    model = transformers.AutoModelForCausalLM.from_config(config_cls)
  model = model.float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        p.add_(0.1 * torch.randn_like(p))
      elif name.endswith("dt_bias"):
        p.add_(0.1 * torch.randn_like(p))
  return model


def save_torch_model(model: torch.nn.Module, path: Path, **kwargs) -> Path:
  model.save_pretrained(path, **kwargs)
  return path


def torch_logits(model: torch.nn.Module, ids) -> torch.Tensor:
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(ids, dtype=torch.long)).logits.float()


@nnx.jit
def _jit_call(model, ids, positions, cache, valid):
  if cache is None:
    return model(ids, positions=positions, valid=valid)
  return model(ids, positions=positions, cache=cache, valid=valid)


def jit_call(model, ids, positions=None, cache=None, valid=None):
  """`model(ids, ...)` under jit (eager op-by-op dispatch is far slower on CPU), with
  full fp32 matmul precision so parity also holds on GPUs (no TF32)."""
  with jax.default_matmul_precision("highest"):
    return _jit_call(model, ids, positions, cache, valid)
