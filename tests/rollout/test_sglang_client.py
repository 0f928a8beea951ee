"""The SGLang client against our own SGLang-protocol server (real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bat_jax.grpo.logprobs import taken_token_logprobs
from bat_jax.model import load_pretrained, save_pretrained
from bat_jax.rollout import AgentLoop, RolloutItem, RolloutLimits, Score
from bat_jax.rollout.engine import GenerateRequest, SamplingParams
from bat_jax.rollout.jax_engine import JaxEngine
from bat_jax.rollout.sglang_client import (ProtocolError, RequestRejectedError, RetryPolicy,
                                           SGLangClient, SGLangEngine, ServerUnavailableError,
                                           parse_generate_response)
from bat_jax.rollout.server import ServeApp, ServedModel, serve_in_thread
from bat_jax.rollout.server.params import RequestError, sglang_sampling
from rollout_fixtures import LONG_ENGINE, SMALL_ENGINE

CFG = SMALL_ENGINE
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
FAST_RETRY = RetryPolicy(max_retries=2, base_delay_s=0.01, max_delay_s=0.02)


@pytest.fixture(scope="module")
def server(model, tokenizer, chat):
  served = ServedModel(engine=JaxEngine(model, CFG, weight_version="init"), model_path="tiny",
                       load=lambda p: load_pretrained(p), tokenizer=tokenizer, chat_format=chat)
  app = ServeApp(served)
  httpd, url = serve_in_thread(app)
  yield url, app
  httpd.shutdown()
  httpd.server_close()
  app.close()


def run(coro):
  return asyncio.run(coro)


async def _generate(url, ids, sampling=GREEDY):
  async with SGLangClient(url, retry=FAST_RETRY) as client:
    return await client.generate(ids, sampling)


def test_generate_returns_ids_and_logprobs_of_the_engine(server, model):
  url, _ = server
  prompt = [5, 17, 99, 3]
  c = run(_generate(url, prompt))
  reference = JaxEngine(model, CFG).generate([GenerateRequest(prompt, GREEDY)])[0]
  assert c.output_ids == reference.output_ids and len(c.output_ids) == 6
  assert c.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
  assert c.finish_reason == "length" and c.prompt_tokens == 4 and c.weight_version == "init"


def test_update_weights_from_disk_changes_outputs_and_version(server, model, tokenizer_dir,
                                                              tmp_path):
  url, app = server
  prompt = [9, 8, 7, 6, 5]
  before = run(_generate(url, prompt))
  other = nnx.clone(model)
  params = nnx.state(other, nnx.Param)
  nnx.update(other, jax.tree.map(lambda x: -x if x.ndim >= 2 else x, params))
  engine = SGLangEngine(url, retry=FAST_RETRY)
  try:
    times = engine.sync_weights(lambda d: save_pretrained(other, d, tokenizer_dir=tokenizer_dir),
                                tmp_path / "step-1", "step-1")
    assert times.export_s > 0 and engine.weight_version == "step-1"
    after = engine.generate([GenerateRequest(prompt, GREEDY)])[0]
  finally:
    engine.close()
  assert after.weight_version == "step-1"
  assert after.output_ids != before.output_ids
  expected = JaxEngine(other, CFG).generate([GenerateRequest(prompt, GREEDY)])[0]
  assert after.output_ids == expected.output_ids
  # The previous weights come back the same way (and the model path follows).
  save_pretrained(model, tmp_path / "step-0")
  info = run(_update_and_info(url, tmp_path / "step-0", "step-0"))
  assert info["weight_version"] == "step-0" and info["model_path"] == str(tmp_path / "step-0")
  assert run(_generate(url, prompt)).output_ids == before.output_ids


async def _update_and_info(url, path, version):
  async with SGLangClient(url, retry=FAST_RETRY) as client:
    await client.update_weights_from_disk(path, version)
    await client.flush_cache()
    return await client.model_info()


def test_unknown_model_path_is_refused_naming_it(server, tmp_path):
  url, _ = server

  async def go():
    async with SGLangClient(url, retry=FAST_RETRY) as client:
      await client.update_weights_from_disk(tmp_path / "missing", "v9")
  with pytest.raises(RequestRejectedError, match="model_path .*missing.* is not a directory"):
    run(go())
  (tmp_path / "empty").mkdir()

  async def go_empty():
    async with SGLangClient(url, retry=FAST_RETRY) as client:
      await client.update_weights_from_disk(tmp_path / "empty", "v9")
  with pytest.raises(RequestRejectedError, match="could not be loaded"):
    run(go_empty())


def test_many_concurrent_requests_are_neither_lost_nor_mixed_up(server, model):
  url, _ = server
  prompts = [[(7 * i) % 300 + 1, (13 * i) % 200 + 2, i % 50 + 3] for i in range(24)]
  expected = JaxEngine(model, CFG).generate([GenerateRequest(p, GREEDY) for p in prompts])
  engine = SGLangEngine(url, retry=FAST_RETRY)
  try:
    got = engine.generate([GenerateRequest(p, GREEDY) for p in prompts])
  finally:
    engine.close()
  assert [c.output_ids for c in got] == [c.output_ids for c in expected]
  assert [c.prompt_tokens for c in got] == [3] * 24
  # Raw threads against the HTTP server too (each thread its own connection).
  with concurrent.futures.ThreadPoolExecutor(12) as pool:
    answers = list(pool.map(lambda p: httpx.post(f"{url}/generate", json={
        "input_ids": p, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "return_logprob": True, "rid": f"r{p[0]}-{p[1]}"}, timeout=120).json(), prompts))
  assert [a["output_ids"] for a in answers] == [list(c.output_ids) for c in expected]
  assert [a["meta_info"]["id"] for a in answers] == [f"r{p[0]}-{p[1]}" for p in prompts]


def test_dead_server_fails_clearly_after_bounded_retries():
  from bat_jax.rollout.sglang_launcher import free_port
  url = f"http://127.0.0.1:{free_port()}"
  start = time.monotonic()
  with pytest.raises(ServerUnavailableError, match=r"failed after 3 attempts.*Is the server"):
    run(_generate(url, [1, 2, 3]))
  assert time.monotonic() - start < 5


def _mock_client(responses: list[httpx.Response], seen: list[str]) -> SGLangClient:
  def handler(request: httpx.Request) -> httpx.Response:
    seen.append(request.url.path)
    return responses.pop(0)
  return SGLangClient("http://mock", retry=FAST_RETRY, transport=httpx.MockTransport(handler))


def test_retries_on_503_and_flush_cache_retries_on_400():
  ok = {"text": "", "output_ids": [4], "meta_info": {
      "finish_reason": {"type": "stop"}, "prompt_tokens": 2,
      "output_token_logprobs": [[-0.5, 4, None]]}}
  seen: list[str] = []

  async def go():
    client = _mock_client([httpx.Response(503, json={"error": "warming up"}),
                           httpx.Response(200, json=ok),
                           httpx.Response(400, json={"error": "busy"}),
                           httpx.Response(400, json={"error": "busy"}),
                           httpx.Response(200, json={"success": True})], seen)
    async with client:
      c = await client.generate([1, 2], GREEDY)
      await client.flush_cache(delay_s=0.0)
    return c
  c = run(go())
  assert c.output_ids == (4,) and c.logprobs == (-0.5,) and c.finish_reason == "stop"
  assert seen == ["/generate", "/generate"] + ["/flush_cache"] * 3


def test_4xx_is_not_retried_and_protocol_errors_are_named():
  seen: list[str] = []

  async def go():
    async with _mock_client([httpx.Response(400, json={"error": {"message": "bad top_p"}})],
                            seen) as client:
      await client.generate([1], GREEDY)
  with pytest.raises(RequestRejectedError, match="HTTP 400: bad top_p"):
    run(go())
  assert seen == ["/generate"]
  with pytest.raises(ProtocolError, match="output_token_logprobs missing"):
    parse_generate_response({"meta_info": {"finish_reason": {"type": "stop"}}}, prompt_tokens=1)
  with pytest.raises(ProtocolError, match=r"output_token_logprobs\[0\]"):
    parse_generate_response({"meta_info": {"finish_reason": "stop",
                                           "output_token_logprobs": [[0.1]]}}, prompt_tokens=1)
  with pytest.raises(ProtocolError, match="output_ids disagree"):
    parse_generate_response({"output_ids": [3], "meta_info": {
        "finish_reason": "stop", "output_token_logprobs": [[-0.1, 4, None]]}}, prompt_tokens=1)


def test_sampling_params_round_trip_the_sglang_json():
  """What the client sends is what an SGLang-protocol server (ours) runs."""
  sp = SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=20,
                      stop_token_ids=(1, 2), seed=-3)
  served = sglang_sampling(json.loads(json.dumps(sp.to_dict())), vocab_size=100,
                           eos_token_ids=(), max_stop_ids=8)
  assert served.engine_params(sp.max_new_tokens, vocab_size=100) == sp
  with pytest.raises(RequestError, match="temprature"):
    sglang_sampling({"temprature": 1.0}, vocab_size=100, eos_token_ids=(), max_stop_ids=8)


class _Recording:
  """Wraps an engine and keeps every completion."""

  def __init__(self, engine):
    self.engine, self.completions = engine, []

  def generate(self, requests):
    out = self.engine.generate(requests)
    self.completions.extend(out)
    return out

  def release(self, session_ids):
    self.engine.release(session_ids)

  @property
  def weight_version(self):
    return self.engine.weight_version


class _NoTools:
  def execute(self, language, code):
    return "exit_code=0\nstdout:\nstderr:"

  def score(self):
    return Score(reward=0.5, stage_items={}, stage_scores={}, task_score=None)


def test_agent_loop_over_http_keeps_trainer_logprobs_and_reuses_prefixes(model, tokenizer, chat):
  """The SGLang path end to end on a CPU: agent loop -> SGLangEngine -> HTTP -> JAX engine."""
  served = ServedModel(engine=JaxEngine(model, LONG_ENGINE), model_path="tiny",
                       load=lambda p: None, tokenizer=tokenizer, chat_format=chat)
  app = ServeApp(served)
  httpd, url = serve_in_thread(app)
  engine = _Recording(SGLangEngine(url, retry=FAST_RETRY))
  try:
    loop = AgentLoop(engine, chat, lambda item, g: _NoTools(),
                     sampling=SamplingParams(temperature=0.7),
                     limits=RolloutLimits(max_assistant_turns=3, max_turn_tokens=5))
    item = RolloutItem("s", "S2", "s_mix", ({"role": "user", "content": "Set up the task."},),
                       None)
    trajs = loop.run([item], group_size=2)
  finally:
    engine.engine.close()
    httpd.shutdown()
    httpd.server_close()
    app.close()
  assert [t.num_turns for t in trajs] == [3, 3] and all(t.reward == 0.5 for t in trajs)
  # Turns after the first continue a cached prefix on the server (no recomputation); the two
  # trajectories' turns interleave in either order.
  assert sorted(c.cached_tokens > 0 for c in engine.completions) == [False] * 2 + [True] * 4
  for t in trajs:  # the sampler's logprobs are the trainer's at the sampling temperature 0.7
    logp, _ = nnx.jit(lambda m, ids: taken_token_logprobs(m, ids, valid=jnp.ones_like(ids, bool), chunk_size=256,
                                                          temperature=0.7))(
        model, jnp.asarray([t.token_ids], jnp.int32))
    mask = np.array(t.loss_mask, bool)
    np.testing.assert_allclose(np.array(t.sampler_logp)[mask], np.asarray(logp[0])[mask],
                               atol=1e-4)
