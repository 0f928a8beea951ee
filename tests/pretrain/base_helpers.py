"""Shared by the tiny base's tests: a 2-layer hybrid model and a pretraining config of a few
steps."""

from flax import nnx

from bat_jax.model import ModelConfig, build_model
from bat_jax.pretrain import base

HF = {"model_type": "qwen3_5_text", "vocab_size": 600, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 2,
      "layer_types": ["full_attention", "linear_attention"], "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 1,
      "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
      "tie_word_embeddings": True}


def pcfg(tmp_path, **kw):
  """Two phases (echo, corpus) unless a test asks for more or fewer: each phase run compiles a
  train step of its own (~8 s), and only the resume and packing tests need all four."""
  fields = dict(echo_steps=2, echo_batch_size=3, echo_seq_len=48, echo_long_steps=0,
                echo_long_batch_size=2, echo_long_seq_len=48, steps=3, batch_size=2,
                seq_len=64, lr=1e-3, warmup_steps=1, seed=5, probes=4, probe_depth=0,
                extend_steps=0, extend_batch_size=1, extend_seq_len=256, extend_lr=5e-4,
                checkpoint_every=100,   # a save at each phase end: a resume restores finished phases
                cache_dir=str(tmp_path / "cache"))
  return base.PretrainConfig(**{**fields, **kw})


def build():
  cfg = ModelConfig.from_hf_dict(HF, dtype="float32", param_dtype="float32")
  return build_model(cfg, rngs=nnx.Rngs(0))
