"""`bat_jax.rollout.server` driven by the official `openai` client, as external harnesses drive it."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from serve_fixtures import path_map, set_bigram_path, start, stop, tiny_model

F_TOOL = {"type": "function", "function": {
    "name": "f", "description": "finish", "parameters": {"type": "object", "properties": {}}}}
F_NEEDS_X = {"type": "function", "function": {
    "name": "f", "description": "finish", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}
USER = [{"role": "user", "content": "List the data."}]


@pytest.fixture(scope="module")
def client(served):
  return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0,
                       timeout=120)


@pytest.fixture(scope="module")
def bigram(tokenizer, chat):
  """A server whose model, greedy or not, answers `</function></tool_call><|im_end|>` after a
  generation prompt or a forced `<function=f>\\n` (see conftest.set_bigram_path)."""
  from bat_jax.rollout.server.openai_api import forced_call_prefix
  model = tiny_model(len(tokenizer))
  answer = chat.encode("</function></tool_call>") + [chat.im_end_id]
  prompt_end = chat.encode_prompt(USER, [])[-1]
  forced_end = chat.encode(forced_call_prefix(chat, "f"))[-1]
  set_bigram_path(model, path_map([[prompt_end] + answer, [forced_end] + answer]))
  app, httpd, base = start(model, tokenizer, chat)
  yield app, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
  stop(app, httpd)


def test_models_list_and_served_model_name(client):
  [model] = client.models.list().data
  assert model.id == "bat-tiny"
  with pytest.raises(openai.NotFoundError, match="unknown model 'gpt-9'.*'bat-tiny'"):
    client.chat.completions.create(model="gpt-9", messages=USER, max_tokens=2)


def test_plain_chat_with_n_2_and_usage(client):
  out = client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=6, n=2,
                                       temperature=1.0, seed=7)
  assert sorted(c.index for c in out.choices) == [0, 1]
  assert all(isinstance(c.message.content, str) for c in out.choices)
  assert all(c.finish_reason in ("length", "stop") for c in out.choices)
  assert out.usage.prompt_tokens > 5 and 2 <= out.usage.completion_tokens <= 12
  assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_stop_strings_cut_the_answer(bigram):
  _, client = bigram
  full = client.chat.completions.create(model="tiny-policy", messages=USER, temperature=0,
                                        max_tokens=10)
  assert full.choices[0].message.content == "</function></tool_call>"
  assert full.choices[0].finish_reason == "stop" and full.usage.completion_tokens == 5
  cut = client.chat.completions.create(model="tiny-policy", messages=USER, temperature=0,
                                       max_tokens=10, stop=["function", "zzz"])
  assert cut.choices[0].message.content == "</"
  assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 2


def test_named_tool_choice_returns_a_parsed_tool_call(bigram):
  _, client = bigram
  out = client.chat.completions.create(
      model="tiny-policy", messages=USER, tools=[F_TOOL], temperature=0.8,
      tool_choice={"type": "function", "function": {"name": "f"}}, max_tokens=10)
  choice = out.choices[0]
  assert choice.finish_reason == "tool_calls"
  [call] = choice.message.tool_calls
  assert call.function.name == "f" and json.loads(call.function.arguments) == {}


def test_malformed_tool_call_comes_back_as_text(bigram):
  _, client = bigram
  out = client.chat.completions.create(  # the call omits the required parameter x
      model="tiny-policy", messages=USER, tools=[F_NEEDS_X], temperature=0,
      tool_choice={"type": "function", "function": {"name": "f"}}, max_tokens=10)
  choice = out.choices[0]
  assert choice.finish_reason == "stop" and not choice.message.tool_calls
  assert "<function=f>" in choice.message.content
  auto = client.chat.completions.create(  # no </think>: the shared parser refuses the turn
      model="tiny-policy", messages=USER, tools=[F_TOOL], temperature=0, max_tokens=10)
  assert auto.choices[0].finish_reason == "stop" and not auto.choices[0].message.tool_calls


def test_streaming_tool_call_deltas_and_usage_chunk(bigram):
  _, client = bigram
  chunks = list(client.chat.completions.create(
      model="tiny-policy", messages=USER, tools=[F_TOOL], temperature=0, max_tokens=10,
      tool_choice={"type": "function", "function": {"name": "f"}}, stream=True,
      stream_options={"include_usage": True}))
  assert all(c.object == "chat.completion.chunk" for c in chunks)
  calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
  assert calls[0].function.name == "f" and calls[0].id.startswith("call_")
  assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {}
  finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
  assert finishes[-1] == "tool_calls" and finishes.count("tool_calls") == 1
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
  content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert "<tool_call>" not in content
  cut = list(client.chat.completions.create(  # a stop string is never streamed, even in part
      model="tiny-policy", messages=USER, temperature=0, max_tokens=10, stream=True,
      stop=["function>"]))
  assert "".join(c.choices[0].delta.content or "" for c in cut) == "</"
  assert cut[-1].choices[0].finish_reason == "stop"


def test_streamed_text_equals_the_plain_answer(client):
  kwargs = dict(model="bat-tiny", messages=USER, max_tokens=24, temperature=0, logprobs=True)
  plain = client.chat.completions.create(**kwargs).choices[0]
  chunks = list(client.chat.completions.create(stream=True, **kwargs))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.message.content
  assert chunks[-1].choices[0].finish_reason == plain.finish_reason
  streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
  assert [(t.token, t.logprob) for t in streamed] == [
      (t.token, t.logprob) for t in plain.logprobs.content]


def test_logprobs_greedy_match_their_top_logprobs(client):
  out = client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
  content = out.choices[0].logprobs.content
  assert len(content) == out.usage.completion_tokens
  for item in content:
    tops = [t.logprob for t in item.top_logprobs]
    assert len(tops) == 3 and tops == sorted(tops, reverse=True)
    # Greedy takes the argmax: the engine's logprob (temperature 1) is the re-scored top one.
    assert item.top_logprobs[0].token == item.token
    assert item.logprob == pytest.approx(tops[0], abs=1e-4)
    assert bytes(item.bytes).decode("utf-8", "replace") == item.token


def test_disconnect_mid_stream_frees_the_slot(served):
  app, base = served
  before = app.scheduler.cancelled
  body = {"model": "bat-tiny", "messages": USER, "max_tokens": 1900, "temperature": 0,
          "stream": True, "stop": ["zzzz-never"]}
  with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as resp:
    lines = resp.iter_lines()
    got = [next(lines) for _ in range(3)]
  assert any(line.startswith("data: ") for line in got)
  deadline = time.time() + 20
  while app.scheduler.running and time.time() < deadline:
    time.sleep(0.05)
  assert app.scheduler.running == 0
  assert app.scheduler.cancelled == before + 1


def test_disconnect_while_waiting_for_a_plain_answer_cancels_it(served):
  app, base = served
  before = app.scheduler.cancelled
  body = {"model": "bat-tiny", "messages": USER, "max_tokens": 1900, "temperature": 1.0,
          "n": 16, "stop": ["zzzz-never"]}  # 16 x 1900 tokens: seconds of work
  with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
    httpx.post(f"{base}/v1/chat/completions", json=body, timeout=0.3)
  deadline = time.time() + 20
  while (app.scheduler.cancelled == before or app.scheduler.running) and (
      time.time() < deadline):
    time.sleep(0.05)
  assert app.scheduler.cancelled > before and app.scheduler.running == 0


def test_eight_concurrent_requests_are_batched_not_serialised(client, served):
  app = served[0]
  prompts = [[{"role": "user", "content": f"Case {i}: run the model."}] for i in range(8)]
  ask = lambda m: client.chat.completions.create(  # noqa: E731
      model="bat-tiny", messages=m, max_tokens=12, temperature=0).choices[0].message.content
  alone = [ask(m) for m in prompts]
  app.scheduler.peak_running = 0
  barrier = threading.Barrier(8)

  def together(m):
    barrier.wait()
    return ask(m)
  with ThreadPoolExecutor(8) as pool:
    batched = list(pool.map(together, prompts))
  assert batched == alone  # rows of a batch are independent: same greedy answers
  assert app.scheduler.peak_running >= 3


def test_sampling_fields_are_honoured(client):
  out = client.chat.completions.create(model="bat-tiny", messages=USER,
                                       max_completion_tokens=3, temperature=0.5, top_p=0.9)
  assert out.usage.completion_tokens <= 3
  assert np.isfinite(out.usage.prompt_tokens)
