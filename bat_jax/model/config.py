"""Decoder configuration read from a Hugging Face `config.json`.

One frozen dataclass covers both supported families:

* `qwen3`: dense decoder, every layer full attention (GQA, q/k RMSNorm, RoPE).
* `qwen3_5` / `qwen3_5_text`: hybrid decoder whose `layer_types` mix
  `linear_attention` (Gated DeltaNet) and `full_attention` (gated attention with
  q/k RMSNorm and partial RoPE). `qwen3_5` is the multimodal checkpoint layout
  (text settings nested under `text_config`, weights under
  `model.language_model.*`); only its language model is used here.

Param dtype (storage, optimizer) and compute dtype (activations, matmuls) are
separate fields so bf16 compute can run on fp32 master weights.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from bat_jax.model.attention import ATTENTION_IMPLS

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_5", "qwen3_5_text")
LAYER_TYPES = ("full_attention", "linear_attention")
CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture + dtype policy of a decoder-only policy model.

  Attributes mirror the Hugging Face names so a reader can map them 1:1.
  `hf_config` keeps the original `config.json` dict (not compared, not hashed)
  so `save_pretrained` writes back exactly what was read.
  """

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  layer_types: tuple[str, ...]
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  partial_rotary_factor: float = 1.0
  max_position_embeddings: int = 32768
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  # Gated DeltaNet (linear_attention layers); unused by qwen3.
  linear_conv_kernel_dim: int = 4
  linear_key_head_dim: int = 128
  linear_value_head_dim: int = 128
  linear_num_key_heads: int = 16
  linear_num_value_heads: int = 32
  # Not in HF configs: implementation knobs.
  deltanet_chunk_size: int = 64
  # Softmax attention kernel: "xla" (dense), "cudnn" (flash, GPU), "chunked"
  # (blockwise, any backend) or None (automatic; see model/attention.py).
  attention_impl: str | None = None
  attention_block_size: int = 512
  # Cache-free forwards longer than this run each decoder layer over sequence tiles of at most
  # this many tokens (DeltaNet state carried, attention queries tiled against all keys), so a
  # layer's backward holds one tile's activations, not the sequence's (None: never tile).
  seq_tile_size: int | None = 8192
  # Stack the repeating layer cycle's params ([num_cycles, ...] per cycle
  # position) and run it under `lax.scan`: compile time independent of depth.
  scan_layers: bool = True
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.float32
  hf_config: Mapping[str, Any] | None = dataclasses.field(
      default=None, compare=False, hash=False, repr=False)

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if len(self.layer_types) != self.num_hidden_layers:
      raise ValueError(
          f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
          f"{self.num_hidden_layers}")
    for i, kind in enumerate(self.layer_types):
      if kind not in LAYER_TYPES:
        raise ValueError(f"layer_types[{i}] = {kind!r} is not one of {LAYER_TYPES}")
    if self.model_type == "qwen3" and "linear_attention" in self.layer_types:
      raise ValueError("model_type 'qwen3' has no linear_attention layers")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
          f"num_key_value_heads ({self.num_key_value_heads})")
    if self.is_hybrid and self.linear_num_value_heads % self.linear_num_key_heads:
      raise ValueError(
          f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
          f"linear_num_key_heads ({self.linear_num_key_heads})")
    if self.attention_impl is not None and self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(
          f"attention_impl {self.attention_impl!r} is not one of {ATTENTION_IMPLS} or None")
    if self.attention_block_size < 1:
      raise ValueError(f"attention_block_size must be positive, got {self.attention_block_size}")
    if self.seq_tile_size is not None and self.seq_tile_size < 1:
      raise ValueError(f"seq_tile_size must be positive or None, got {self.seq_tile_size}")
    if self.rotary_dim % 2:
      raise ValueError(
          f"head_dim * partial_rotary_factor = {self.rotary_dim} must be even")

  # -- derived architecture flags -------------------------------------------

  @property
  def is_hybrid(self) -> bool:
    """Qwen3.5 family: DeltaNet layers, gated attention, (1 + w) RMSNorm."""
    return self.model_type in ("qwen3_5", "qwen3_5_text")

  @property
  def attn_output_gate(self) -> bool:
    return self.is_hybrid

  @property
  def zero_centered_norm(self) -> bool:
    """Qwen3.5 RMSNorm scales by (1 + w) with w initialised to 0."""
    return self.is_hybrid

  @property
  def rotary_dim(self) -> int:
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def layer_cycle(self) -> int:
    """Length of the shortest repeating pattern of `layer_types` (Qwen3.5:
    DeltaNet x3 + attention = 4; Qwen3: 1); the whole stack when irregular."""
    n = self.num_hidden_layers
    for period in range(1, n + 1):
      if n % period == 0 and self.layer_types == self.layer_types[:period] * (n // period):
        return period
    return n

  @property
  def num_cycles(self) -> int:
    return self.num_hidden_layers // self.layer_cycle

  @property
  def is_multimodal_layout(self) -> bool:
    """Checkpoint keys live under `model.language_model.*` (Qwen3.5 VLM)."""
    return self.model_type == "qwen3_5"

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  # -- construction from HF ---------------------------------------------------

  @classmethod
  def from_hf_dict(cls, d: Mapping[str, Any], *, dtype=None, param_dtype=None) -> ModelConfig:
    """Builds a config from a parsed `config.json` (nested `text_config` ok)."""
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(
          f"unsupported model_type {model_type!r} in config; supported: {SUPPORTED_MODEL_TYPES}")
    text = _text_config(d, model_type)

    def need(key: str):
      if key not in text:
        raise KeyError(f"config.json is missing required field {key!r} (model_type {model_type})")
      return text[key]

    num_layers = int(need("num_hidden_layers"))
    num_heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    layer_types = _layer_types(text, model_type, num_layers)
    if model_type == "qwen3" and text.get("use_sliding_window"):
      raise ValueError("config field 'use_sliding_window' = true is not supported")
    act = text.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"config field 'hidden_act' = {act!r} is not supported (only 'silu')")

    rope_theta, partial = _rope(text, model_type)

    kwargs: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(text.get("num_key_value_heads", num_heads)),
        head_dim=int(text.get("head_dim") or hidden // num_heads),
        layer_types=tuple(layer_types),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        partial_rotary_factor=float(partial),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        attention_bias=bool(text.get("attention_bias", False)),
        hf_config=json.loads(json.dumps(d)),  # deep copy, JSON-clean
    )
    if model_type != "qwen3":
      for key in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_num_key_heads", "linear_num_value_heads"):
        if key in text:
          kwargs[key] = int(text[key])
    if dtype is not None:
      kwargs["dtype"] = jnp.dtype(dtype)
    if param_dtype is not None:
      kwargs["param_dtype"] = jnp.dtype(param_dtype)
    return cls(**kwargs)

  @classmethod
  def from_pretrained_dir(cls, path: str | Path, *, dtype=None, param_dtype=None) -> ModelConfig:
    """Reads `<path>/config.json`."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
      raise FileNotFoundError(f"missing model config file: {config_path}")
    try:
      d = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    return cls.from_hf_dict(d, dtype=dtype, param_dtype=param_dtype)

  def to_hf_dict(self) -> dict[str, Any]:
    """The `config.json` dict to write next to exported weights.

    Starts from the dict this config was read from (so unknown fields such as
    token ids and the vision config survive) and overwrites the architecture
    fields with this config's values.
    """
    arch: dict[str, Any] = dict(
        vocab_size=self.vocab_size,
        hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_hidden_layers,
        num_attention_heads=self.num_attention_heads,
        num_key_value_heads=self.num_key_value_heads,
        head_dim=self.head_dim,
        layer_types=list(self.layer_types),
        rms_norm_eps=self.rms_norm_eps,
        max_position_embeddings=self.max_position_embeddings,
        tie_word_embeddings=self.tie_word_embeddings,
        attention_bias=self.attention_bias,
        hidden_act="silu",
        model_type="qwen3" if self.model_type == "qwen3" else "qwen3_5_text",
    )
    rope = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.is_hybrid:
      rope["partial_rotary_factor"] = self.partial_rotary_factor
      arch.update(
          linear_conv_kernel_dim=self.linear_conv_kernel_dim,
          linear_key_head_dim=self.linear_key_head_dim,
          linear_value_head_dim=self.linear_value_head_dim,
          linear_num_key_heads=self.linear_num_key_heads,
          linear_num_value_heads=self.linear_num_value_heads,
      )
    dtype_name = jnp.dtype(self.param_dtype).name
    original = json.loads(json.dumps(self.hf_config)) if self.hf_config else {}
    if self.model_type == "qwen3_5":
      text = original.get("text_config", {})
      old_rope = dict(text.get("rope_parameters") or {})
      text.update(arch, rope_parameters={**old_rope, **rope}, dtype=dtype_name)
      text.pop("rope_theta", None)
      text.pop("partial_rotary_factor", None)
      out = {**original, "text_config": text, "model_type": "qwen3_5",
             "tie_word_embeddings": self.tie_word_embeddings}
      out.setdefault("architectures", ["Qwen3_5ForConditionalGeneration"])
    else:
      old_rope = dict(original.get("rope_parameters") or {})
      out = {**original, **arch, "rope_parameters": {**old_rope, **rope}}
      out.pop("rope_theta", None)
      out.pop("partial_rotary_factor", None)
      out.pop("rope_scaling", None)
      arch_name = "Qwen3ForCausalLM" if self.model_type == "qwen3" else "Qwen3_5ForCausalLM"
      out.setdefault("architectures", [arch_name])
    out["dtype"] = dtype_name
    out.pop("torch_dtype", None)
    return out


def _text_config(d: Mapping[str, Any], model_type: str) -> Mapping[str, Any]:
  """The text model's fields: `d` itself, or Qwen3.5's nested `text_config`."""
  if model_type != "qwen3_5":
    return d
  if "text_config" not in d:
    raise ValueError("config with model_type 'qwen3_5' is missing 'text_config'")
  text = {**d["text_config"]}
  # Some VLM configs keep tie_word_embeddings only at the top level.
  text.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
  return text


def _layer_types(text: Mapping[str, Any], model_type: str, num_layers: int) -> list[str]:
  layer_types = text.get("layer_types")
  if layer_types is not None:
    return layer_types
  if model_type == "qwen3":
    return ["full_attention"] * num_layers
  # HF default: every `full_attention_interval`-th layer is full attention.
  interval = int(text.get("full_attention_interval", 4))
  return ["linear_attention" if (i + 1) % interval else "full_attention"
          for i in range(num_layers)]


def _rope(text: Mapping[str, Any], model_type: str) -> tuple[Any, Any]:
  """(rope_theta, partial_rotary_factor); only the default RoPE is supported."""
  rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise ValueError(f"config rope_type {rope_type!r} is not supported (only 'default')")
  rope_theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
  default_partial = 0.25 if model_type != "qwen3" else 1.0
  partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", default_partial))
  return rope_theta, partial
