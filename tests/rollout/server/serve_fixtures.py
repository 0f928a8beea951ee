"""Helpers of the serve tests: tiny models, bigram paths, servers over real engines on HTTP.

A plain module (not conftest) so test files can import it by a unique name.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from bat_jax.model import ModelConfig, build_model
from bat_jax.rollout import server as serve
from bat_jax.rollout.jax_engine import JaxEngine, JaxEngineConfig

MAX_LEN = 2048
# Same engine shapes as tests/rollout, so one pytest run compiles them once.
ENGINE = JaxEngineConfig(num_slots=4, max_len=MAX_LEN, prefill_chunk=256, decode_block=8)


def tiny_model(vocab_size: int) -> nnx.Module:
  cfg = ModelConfig(model_type="qwen3_5_text", vocab_size=vocab_size, hidden_size=32,
                    intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8,
                    layer_types=("linear_attention", "full_attention"), linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_conv_kernel_dim=4, partial_rotary_factor=0.5,
                    tie_word_embeddings=False, deltanet_chunk_size=8)
  return build_model(cfg, rngs=nnx.Rngs(0))


def set_bigram_path(model: nnx.Module, successor: dict[int, int]) -> None:
  """Makes the model's next token a function of the current one on `successor`'s tokens.

  Each mapped token embeds as a large orthonormal direction (the layers' O(1) contributions
  cannot turn it), and the head scores only the successors, so decoding from a mapped token
  follows the map whatever came before (greedy, and at temperature 1 too: the margin is ~500).
  """
  dim = model.embed_tokens.embedding.shape[1]
  keys = sorted(successor)
  assert len(keys) <= dim
  basis = np.linalg.qr(np.random.default_rng(0).normal(size=(dim, dim)))[0][:, :len(keys)].T
  emb = np.array(model.embed_tokens.embedding[...])
  head = np.zeros_like(np.array(model.lm_head[...]))                    # [V, D]
  for row, t in zip(basis, keys):
    emb[t] = 1000.0 * row
    head[successor[t]] += 100.0 * row
  model.embed_tokens.embedding[...] = emb
  model.lm_head[...] = head


def path_map(paths: list[list[int]]) -> dict[int, int]:
  """Successor map of token paths; a token with two different successors is a fixture bug."""
  succ: dict[int, int] = {}
  for path in paths:
    for a, b in zip(path, path[1:]):
      assert succ.setdefault(a, b) == b, f"token {a} needs two successors"
  return succ


def start(model, tokenizer, chat, **served_kwargs):
  engine = JaxEngine(model, ENGINE)
  served = serve.ServedModel(engine=engine, model_path="/ckpt/tiny-policy", load=lambda p: None,
                             tokenizer=tokenizer, chat_format=chat,
                             graphdef=nnx.split(model)[0], **served_kwargs)
  app = serve.ServeApp(served)
  httpd, base = serve.serve_in_thread(app, body_timeout_s=0.5)
  return app, httpd, base


def stop(app, httpd) -> None:
  httpd.shutdown()
  httpd.server_close()
  app.close()
