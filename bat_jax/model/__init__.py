"""Decoder-only policy models (Qwen3, Qwen3.5) in Flax NNX with HF checkpoint IO.

The tokenizer (`tokenizer`), chat format (`chat_format`) and tool-call parser (`tool_parser`) are
imported from their own modules (they pull in transformers).
"""

from bat_jax.model.config import ModelConfig
from bat_jax.model.decoder import CausalLM, DecodeCache, build_model
from bat_jax.model.deltanet import DeltaNetState
from bat_jax.model.hf_io import hf_state_dict, load_pretrained, save_pretrained
from bat_jax.model.layers import KVCache

__all__ = [
    "CausalLM",
    "DecodeCache",
    "DeltaNetState",
    "KVCache",
    "ModelConfig",
    "build_model",
    "hf_state_dict",
    "load_pretrained",
    "save_pretrained",
]
