"""SGLang 0.5.23's answers the client must read right: context 400, abort, null logprob, retries.

The bodies below are SGLang 0.5.23's own (texts copied from its tokenizer_manager.py /
http_server.py); SGLang needs CUDA, so they come from an httpx mock transport, and the same
context-400 path is also run over real HTTP against `bat_jax.rollout.server`.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest

from bat_jax.bicurl.policy import SGLangPolicyServer
from bat_jax.config_validation import ConfigError, validate_config
from bat_jax.rollout import (AgentLoop, RolloutItem, RolloutLimits, Score, Trajectory,
                             collate)
from bat_jax.rollout.engine import GenerateRequest, PromptTooLongError, SamplingParams
from bat_jax.rollout.jax_engine import JaxEngine, JaxEngineConfig
from bat_jax.rollout.sglang_client import (ContextLengthExceededError, RequestRejectedError,
                                           RetryPolicy, SGLangClient, SGLangEngine,
                                           SGLangError, ServerUnavailableError)
from bat_jax.rollout.server import ServeApp, ServedModel, serve_in_thread
from bat_jax.rollout.sglang_launcher import free_port
from configs import tiny
from rollout_fixtures import SMALL_ENGINE

FAST_RETRY = RetryPolicy(max_retries=2, base_delay_s=0.01, max_delay_s=0.02)
SAMPLING = SamplingParams(max_new_tokens=4, temperature=0.7)
# SGLang 0.5.23, TokenizerManager._validate_one_request -> _create_error_response (HTTP 400).
CONTEXT_400 = {"error": {"message": "The input (4100 tokens) is longer than the model's context "
                                    "length (4096 tokens)."}}
TOTAL_400 = {"error": {"message": (
    "Requested token count exceeds the model's maximum context length of 4096 tokens. You "
    "requested a total of 4200 tokens: 4000 tokens from the input messages and 200 tokens for "
    "the completion. Please reduce the number of tokens in the input messages or the "
    "completion to fit within the limit.")}}


def _answer(ids, logprobs, finish):
  return {"text": "", "output_ids": ids, "meta_info": {
      "id": "r", "finish_reason": finish, "prompt_tokens": 3, "weight_version": "",
      "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}}


def _engine(handler, seen=None) -> SGLangEngine:
  def record(request: httpx.Request) -> httpx.Response:
    if seen is not None:
      seen.append(request.url.path)
    return handler(request)
  return SGLangEngine("http://mock", retry=FAST_RETRY, transport=httpx.MockTransport(record))


class _NoTools:
  def execute(self, language, code):
    return "exit_code=0"

  def score(self):
    return Score(reward=0.5, stage_items={}, stage_scores={}, task_score=None)


def _rollout(engine, chat, group_size=2):
  loop = AgentLoop(engine, chat, lambda item, g: _NoTools(), sampling=SAMPLING,
                   limits=RolloutLimits(max_assistant_turns=2, max_turn_tokens=4))
  item = RolloutItem("s", "S2", "s_mix", ({"role": "user", "content": "Set up."},), None)
  return loop.run([item], group_size=group_size)


@pytest.mark.parametrize("body", [CONTEXT_400, TOTAL_400], ids=["input", "input+new"])
def test_sglang_context_400_ends_the_trajectory_as_context_full_like_the_jax_engine(
    body, chat, model):
  engine = _engine(lambda r: httpx.Response(400, json=body))
  try:
    with pytest.raises(ContextLengthExceededError, match="context length") as e:
      engine.generate([GenerateRequest([1, 2, 3], SAMPLING)])
    assert isinstance(e.value, PromptTooLongError)
    over_http = _rollout(engine, chat)
  finally:
    engine.close()
  # The JAX engine, with a context the prompt does not fit, gives the same outcome.
  tiny_context = JaxEngine(model, JaxEngineConfig(num_slots=2, max_len=8, prefill_chunk=8,
                                                  decode_block=4))
  in_process = _rollout(tiny_context, chat)
  for t in over_http + in_process:
    assert t.finish_reason == "context_full" and t.trainable and t.error is None
    assert sum(t.loss_mask) == 0 and t.reward == 0.5


def test_other_400s_stay_errors_and_are_not_trainable(chat):
  engine = _engine(lambda r: httpx.Response(
      400, json={"error": {"message": "top_k must be -1 (disable) or at least 1, got 0."}}))
  try:
    trajs = _rollout(engine, chat)
  finally:
    engine.close()
  assert all(t.finish_reason == "error" and not t.trainable and t.reward == 0 for t in trajs)
  assert "top_k must be -1" in trajs[0].error


def test_abort_is_marked_aborted_never_trained_on(chat):
  """An SGLang abort (HTTP 200, finish_reason type "abort") is not the policy ending its turn."""
  abort = {"type": "abort", "message": "Abort before prefill", "status_code": None,
           "err_type": None}
  answers = iter([_answer([7, 8], [-0.1, -0.2], abort), _answer([9], [-0.3], abort)])
  engine = _engine(lambda r: httpx.Response(200, json=next(answers)))
  try:
    trajs = _rollout(engine, chat)
  finally:
    engine.close()
  for t in trajs:
    assert t.finish_reason == "aborted" and not t.trainable and t.reward == 0.0
    assert sum(t.loss_mask) == 0 and len(t.token_ids) == t.prompt_len  # the cut turn is gone
  batch = collate(trajs)
  assert not batch["trainable"].any() and not batch["loss_mask"].any()


def test_null_logprob_is_nan_not_a_crash():
  engine = _engine(lambda r: httpx.Response(200, json=_answer(
      [4, 5], [None, -0.25], {"type": "length"})))
  try:
    c = engine.generate([GenerateRequest([1, 2, 3], SAMPLING)])[0]
  finally:
    engine.close()
  assert c.output_ids == (4, 5) and math.isnan(c.logprobs[0]) and c.logprobs[1] == -0.25
  t = Trajectory(state_id="s", focus="S1", pool="p", task_id="t", sample_index=0,
                 token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 0, 0, 1, 1],
                 sampler_logp=[0.0, 0.0, 0.0, *c.logprobs], prompt_len=3, finish_reason="max_turns")
  batch = collate([t])  # the unknown token is not trained on; nothing NaN reaches the trainer
  assert batch["loss_mask"].tolist() == [[0, 0, 0, 0, 1]]
  assert batch["sampler_logp"].tolist() == [[0, 0, 0, 0, -0.25]]


def test_retries_only_connection_errors_and_5xx_and_model_info_is_the_endpoint():
  seen: list[str] = []
  replies = iter([httpx.Response(500, json={"error": "oops"}),
                  httpx.Response(502, text="bad gateway"),
                  httpx.Response(200, json={"model_path": "/m", "weight_version": "v3"}),
                  httpx.Response(429, json={"error": {"message": "slow down"}})])

  def handler(request):
    seen.append(request.url.path)
    return next(replies)

  async def go():
    async with SGLangClient("http://mock", retry=FAST_RETRY,
                            transport=httpx.MockTransport(handler)) as client:
      version = await client.weight_version()
      with pytest.raises(RequestRejectedError, match="HTTP 429: slow down"):
        await client.model_info()
      return version
  assert asyncio.run(go()) == "v3"
  assert seen == ["/model_info"] * 4  # 500, 502 retried; 429 is not

  def timeout(request):
    seen.append("timeout")
    raise httpx.ReadTimeout("read timed out", request=request)

  async def slow():
    async with SGLangClient("http://mock", retry=FAST_RETRY,
                            transport=httpx.MockTransport(timeout)) as client:
      await client.generate([1], SAMPLING)
  with pytest.raises(httpx.ReadTimeout):
    asyncio.run(slow())
  assert seen.count("timeout") == 1  # a slow generate is not sent again


def test_stale_weight_version_in_an_answer_is_refused(tmp_path):
  """After a sync to "step-2", an answer produced by "step-1" weights is an error."""
  def handler(request):
    return {"/update_weights_from_disk": lambda: httpx.Response(200, json={"success": True}),
            "/flush_cache": lambda: httpx.Response(200, text="Cache flushed."),
            "/model_info": lambda: httpx.Response(200, json={"weight_version": "step-2"}),
            "/generate": lambda: httpx.Response(200, json=_answer(
                [4], [-0.5], {"type": "stop"}) | {"meta_info": {
                    **_answer([4], [-0.5], {"type": "stop"})["meta_info"],
                    "weight_version": "step-1"}}),
            }[request.url.path]()
  engine = _engine(handler)
  try:
    engine.sync_weights(lambda d: (d / "config.json").write_text("{}"), tmp_path, "step-2")
    with pytest.raises(SGLangError, match=r"weight_version \['step-1'\], expected 'step-2'"):
      engine.generate([GenerateRequest([1], SAMPLING)])
  finally:
    engine.close()


def test_context_400_over_real_http_from_bat_jax_serve(model, tokenizer, chat):
  served = ServedModel(engine=JaxEngine(model, SMALL_ENGINE), model_path="tiny",
                       load=lambda p: None, tokenizer=tokenizer, chat_format=chat)
  app = ServeApp(served)
  httpd, url = serve_in_thread(app)
  engine = SGLangEngine(url, retry=FAST_RETRY)
  try:
    with pytest.raises(ContextLengthExceededError, match=r"The input \(96 tokens\) is longer"):
      engine.generate([GenerateRequest([1] * SMALL_ENGINE.max_len, SAMPLING)])
  finally:
    engine.close()
    httpd.shutdown()
    httpd.server_close()
    app.close()


def test_config_refuses_top_k_0_and_the_policy_server_reads_max_retries(tmp_path):
  cfg = tiny.get_config("smoke")
  with cfg.unlocked():
    cfg.rollout.sampling.top_k = 0
  with pytest.raises(ConfigError, match=r"config.rollout.sampling: .*top_k = 0"):
    validate_config(cfg)
  cfg = tiny.get_config("smoke")
  with cfg.unlocked():
    cfg.rollout.engine = "sglang"
    cfg.rollout.sglang.launch = False
    cfg.rollout.sglang.urls = (f"http://127.0.0.1:{free_port()}",)
    cfg.rollout.sglang.max_retries = 1
  validate_config(cfg)
  server = SGLangPolicyServer(None, cfg, tmp_path / "w", tmp_path / "tok", tmp_path / "log")
  start = time.monotonic()
  try:
    with pytest.raises(ServerUnavailableError, match="failed after 2 attempts"):
      server.engine.generate([GenerateRequest([1], SAMPLING)])
  finally:
    server.close()
  assert time.monotonic() - start < 5  # the default (5 retries) would make 6 attempts
