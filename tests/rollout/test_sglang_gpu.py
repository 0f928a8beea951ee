"""Against a real SGLang server (GPU only; `bash .ci/run --setup-only --gpu` makes its venv).

Launches `<.venv-sglang>/bin/python -m sglang.launch_server` (or `$BAT_SGLANG_PYTHON`) on a tiny
random Qwen3 checkpoint written by `bat_jax.model.save_pretrained`, then checks the client
protocol end to end: SGLang's returned logprobs at temperature 0.7 equal the trainer's
recomputation at logits / 0.7 for the same tokens, and a weight sync through
`update_weights_from_disk` changes the outputs and the reported version.
"""

from __future__ import annotations

import asyncio
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bat_jax.grpo.logprobs import taken_token_logprobs
from bat_jax.model import ModelConfig, build_model, save_pretrained
from bat_jax.rollout import (SamplingParams, SGLangClient, SGLangEngine, SGLangLaunchConfig,
                             ServerProcess, free_port)
from bat_jax.rollout.engine import GenerateRequest

pytestmark = pytest.mark.gpu
SGLANG_PYTHON = pathlib.Path(os.environ.get(
    "BAT_SGLANG_PYTHON", pathlib.Path(__file__).resolve().parents[2] / ".venv-sglang/bin/python"))


def qwen3_model(vocab_size: int, seed: int):
  cfg = ModelConfig(model_type="qwen3", vocab_size=vocab_size, hidden_size=128,
                    intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, layer_types=("full_attention",) * 2,
                    tie_word_embeddings=False)
  model = build_model(cfg, rngs=nnx.Rngs(seed))
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: x * 10 if x.ndim >= 2 else x, params))
  return model


def test_real_sglang_generate_logprobs_and_weight_sync(tokenizer_dir, tokenizer, tmp_path):
  if not SGLANG_PYTHON.is_file():
    pytest.skip(f"no SGLang interpreter at {SGLANG_PYTHON} (bash .ci/run --setup-only --gpu)")
  model = qwen3_model(len(tokenizer), 0)
  save_pretrained(model, tmp_path / "v0", tokenizer_dir=tokenizer_dir)
  cfg = SGLangLaunchConfig(model_path=str(tmp_path / "v0"), port=free_port(), dtype="float32",
                           mem_fraction_static=0.3, python=str(SGLANG_PYTHON),
                           extra_args=("--disable-cuda-graph",))
  prompt = [5, 17, 99, 3, 250, 41, 7]
  greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
  with ServerProcess.sglang(cfg, tmp_path / "sglang.log", startup_timeout_s=900) as server:
    engine = SGLangEngine(server.base_url)
    try:
      before = engine.generate([GenerateRequest(prompt, greedy)])[0]
      sampled = engine.generate([GenerateRequest(prompt, SamplingParams(
          max_new_tokens=16, temperature=0.7))])[0]
      seq = prompt + list(sampled.output_ids)
      logp, _ = taken_token_logprobs(model, jnp.asarray([seq], jnp.int32),
                                    valid=jnp.ones((1, len(seq)), bool), temperature=0.7)
      np.testing.assert_allclose(sampled.logprobs, np.asarray(logp[0, len(prompt):]),
                                 atol=2e-3)
      other = qwen3_model(len(tokenizer), 1)
      times = engine.sync_weights(lambda d: save_pretrained(other, d), tmp_path / "v1", "v1")
      after = engine.generate([GenerateRequest(prompt, greedy)])[0]
    finally:
      engine.close()

    async def version():
      async with SGLangClient(server.base_url) as client:
        return await client.weight_version()
    assert asyncio.run(version()) == "v1"
  assert after.output_ids != before.output_ids
  print(f"sglang weight sync: export {times.export_s:.2f}s update {times.update_s:.2f}s "
        f"flush {times.flush_s:.2f}s")
