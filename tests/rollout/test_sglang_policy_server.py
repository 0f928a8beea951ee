"""The SGLang policy server with `python -m bat_jax.serve` launched in place of SGLang.

One real subprocess, real HTTP: launch flags from `rollout.sglang`, the bf16 export, per-step
weight sync with version checks, memory release after the rollouts and resume before the next
sync. The whole outer loop on this path is tests/bicurl/test_sglang_path.py (slow).
"""

from __future__ import annotations

import json

import jax
import numpy as np
from flax import nnx

from bat_jax.bicurl.policy import SGLangPolicyServer, make_policy_server
from bat_jax.run_config import RunConfig
from bat_jax.rollout.engine import GenerateRequest, SamplingParams
from tests.rollout.process_checks import group_alive
from configs import tiny

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
PROMPT = [9, 8, 7, 6, 5]


def _config():
  cfg = tiny.get_config("smoke")
  cfg.update_from_flattened_dict({
      "rollout.engine": "sglang", "rollout.sglang.server_module": "bat_jax.serve",
      "rollout.sglang.port": 0, "rollout.sglang.dp_size": 1,
      "rollout.sglang.release_memory": True, "rollout.sglang.startup_timeout_s": 300.0,
      "rollout.limits.max_context_tokens": 64,
      "rollout.sglang.extra_args": ("--num-slots", "2", "--prefill-chunk", "32",
                                    "--decode-block", "8")})
  return RunConfig.from_config(cfg)


def test_launched_bat_jax_serve_syncs_weights_per_step_and_releases_memory(
    model, tokenizer_dir, tmp_path):
  cfg = _config()
  server = make_policy_server(model, cfg, tmp_path, tokenizer_dir)
  assert isinstance(server, SGLangPolicyServer)
  try:
    command = server.process.command
    assert command[1:3] == ["-m", "bat_jax.serve"]
    joined = " ".join(command)
    for flag in ("--dtype bfloat16", "--context-length 64", "--enable-memory-saver",
                 f"--model-path {tmp_path / 'sglang_weights'}", f"--random-seed {cfg.seed}"):
      assert flag in joined
    exported = json.loads((tmp_path / "sglang_weights" / "config.json").read_text())
    assert exported["dtype"] == "bfloat16"

    server.load(model, "round_000000-step0")
    first = server.engine.generate([GenerateRequest(PROMPT, GREEDY)])[0]
    assert first.weight_version == "round_000000-step0" and len(first.output_ids) == 6
    server.rollouts_done()  # the train step would run now, with the server's memory freed
    assert server.memory_released

    other = nnx.clone(model)
    params = nnx.state(other, nnx.Param)
    nnx.update(other, jax.tree.map(lambda x: -x if x.ndim >= 2 else x, params))
    server.load(other, "round_000000-step1")  # resume, export, update, flush, version check
    assert not server.memory_released
    second = server.engine.generate([GenerateRequest(PROMPT, GREEDY)])[0]
    assert second.weight_version == "round_000000-step1"
    assert second.output_ids != first.output_ids
    assert np.all(np.isfinite(second.logprobs))
    pgid = server.process.pid
  finally:
    server.close()
  assert not group_alive(pgid)
