"""vLLM / SGLang-level OpenAI compatibility of `bat_jax.rollout.server`, driven by the `openai`
client: ignored unknown fields, chat_template_kwargs, reasoning_content, tool_choice required,
the developer role, response_format, /v1/completions with echo and logprobs, /v1/models/{id},
--api-key, raw token bytes and the max_tokens check."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from bat_jax.rollout.server.openai_api import forced_call_prefix
from serve_fixtures import path_map, set_bigram_path, start, stop, tiny_model

USER = [{"role": "user", "content": "List the data."}]
F_TOOL = {"type": "function", "function": {
    "name": "f", "description": "finish", "parameters": {"type": "object", "properties": {}}}}
ANSWER = "Sure</think>Done."


def _client(base: str, key: str = "unused") -> openai.OpenAI:
  return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def _scripted_server(tokenizer, chat, paths):
  model = tiny_model(len(tokenizer))
  set_bigram_path(model, path_map(paths))
  return start(model, tokenizer, chat, served_name="bat-tiny")


@pytest.fixture(scope="module")
def scripted(tokenizer, chat):
  """A model that answers ANSWER after the thinking generation prompt and an `é` in two byte
  tokens after the non-thinking one."""
  vocab, end = tokenizer.get_vocab(), [chat.im_end_id]
  thinking_end = chat.encode_prompt(USER, [])[-1]
  plain_end = type(chat)(chat.family, tokenizer, enable_thinking=False).encode_prompt(
      USER, [])[-1]
  e_acute = [vocab["Ã"], vocab["©"]]   # the byte-level symbols of 0xC3 0xA9 ("é")
  app, httpd, base = _scripted_server(tokenizer, chat, [
      [thinking_end] + chat.encode(ANSWER) + end, [plain_end] + e_acute + end])
  yield app, base
  stop(app, httpd)


@pytest.fixture(scope="module")
def caller(tokenizer, chat):
  """A model that calls f after the tool_choice=required prefix (`<tool_call>\\n`)."""
  prefix_end = chat.encode(forced_call_prefix(chat, None))[-1]
  app, httpd, base = _scripted_server(tokenizer, chat, [
      [prefix_end] + chat.encode("<function=f>\n</function></tool_call>") + [chat.im_end_id]])
  yield app, base
  stop(app, httpd)


def test_unknown_fields_are_ignored_with_one_warning_each(served, caplog):
  client = _client(served[1])
  extra = {"repetition_penalty": 1.1, "store": True, "metadata": {"a": "b"},
           "reasoning_effort": "low", "service_tier": "auto", "frobnicate": 1}
  with caplog.at_level(logging.WARNING, logger="bat_jax.serve"):
    for _ in range(2):
      out = client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=2,
                                           extra_body=extra)
      assert out.choices[0].finish_reason in ("stop", "length")
  for name in extra:
    hits = [r for r in caplog.records if f"unknown field {name!r}" in r.getMessage()]
    assert len(hits) == 1, name


def test_chat_template_kwargs_switch_thinking_and_reasoning_is_split(scripted, chat):
  client = _client(scripted[1])
  on = client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=20,
                                      temperature=0)
  assert on.choices[0].message.content == "Done."
  assert on.choices[0].message.model_extra["reasoning_content"] == "Sure"
  streamed = client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=20,
                                            temperature=0, stream=True)
  parts = {"reasoning_content": "", "content": ""}
  for chunk in streamed:
    for c in chunk.choices:
      parts["content"] += c.delta.content or ""
      parts["reasoning_content"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
  assert parts == {"reasoning_content": "Sure", "content": "Done."}
  off = client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=20,
                                       temperature=0, logprobs=True,
                                       extra_body={"chat_template_kwargs":
                                                   {"enable_thinking": False}})
  # The prompt closes an empty think block: 2 more prompt tokens, another (scripted) answer.
  assert off.usage.prompt_tokens > on.usage.prompt_tokens
  assert off.choices[0].message.content == "é"
  assert off.choices[0].message.model_extra.get("reasoning_content") is None
  # Raw bytes of the two partial-UTF-8 tokens: each alone is not valid UTF-8.
  items = off.choices[0].logprobs.content
  assert [i.bytes for i in items[:2]] == [[0xC3], [0xA9]]
  assert bytes(items[0].bytes + items[1].bytes).decode("utf-8") == "é"
  with pytest.raises(openai.BadRequestError, match="enable_thinking"):
    client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=2, extra_body={
        "chat_template_kwargs": {"enable_thinking": "no"}})


def test_tool_choice_required_and_developer_role(caller):
  client = _client(caller[1])
  out = client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=30,
                                       temperature=0, tools=[F_TOOL], tool_choice="required")
  assert out.choices[0].finish_reason == "tool_calls"
  assert [c.function.name for c in out.choices[0].message.tool_calls] == ["f"]
  as_system = client.chat.completions.create(
      model="bat-tiny", max_tokens=1, messages=[{"role": "system", "content": "Be brief."}] + USER)
  as_developer = client.chat.completions.create(
      model="bat-tiny", max_tokens=1,
      messages=[{"role": "developer", "content": "Be brief."}] + USER)
  assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens


def test_models_retrieve_api_key_and_max_tokens(model, tokenizer, chat, tmp_path):
  app, httpd, base = start(model, tokenizer, chat, served_name="bat-tiny")
  app.api_key = "s3cret"
  try:
    with pytest.raises(openai.AuthenticationError, match="API key"):
      _client(base, "wrong").models.list()
    good = _client(base, "s3cret")
    assert good.models.retrieve("bat-tiny").id == "bat-tiny"
    with pytest.raises(openai.NotFoundError, match="unknown model 'gpt-9'"):
      good.models.retrieve("gpt-9")
    for path in ("/update_weights_from_disk", "/flush_cache", "/release_memory_occupation"):
      r = httpx.post(base + path, json={"model_path": str(tmp_path)})
      assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/model_info",
                     headers={"Authorization": "Bearer s3cret"}).status_code == 200
    with pytest.raises(openai.BadRequestError,
                       match=r"maximum context length is 2048 tokens.*\(\d+ in the messages, "
                             r"5000 in the completion\)"):
      good.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=5000)
  finally:
    stop(app, httpd)


def test_completions_echo_scores_the_prompt_like_the_engine(served, tokenizer):
  app, base = served
  client = _client(base)
  gen = client.completions.create(model="bat-tiny", prompt="List the data", max_tokens=3,
                                  temperature=0, logprobs=2)
  [choice] = gen.choices
  assert len(choice.logprobs.tokens) == 3 and choice.text == "".join(choice.logprobs.tokens)
  assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
  prompt_ids = tokenizer.encode("List the data", add_special_tokens=False)
  sglang = httpx.post(base + "/generate", timeout=60, json={
      "input_ids": prompt_ids, "return_logprob": True,
      "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
  out_ids = sglang["output_ids"]
  echo = client.completions.create(model="bat-tiny", prompt=prompt_ids + out_ids,
                                   max_tokens=0, echo=True, logprobs=1)
  lp = echo.choices[0].logprobs
  assert echo.choices[0].text == tokenizer.decode(prompt_ids + out_ids)
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  assert len(lp.token_logprobs) == len(prompt_ids) + len(out_ids)
  # The prompt scorer and the engine agree on the greedy tokens' logprobs (temperature 1).
  engine = [row[0] for row in sglang["meta_info"]["output_token_logprobs"]]
  assert lp.token_logprobs[len(prompt_ids):] == pytest.approx(engine, abs=2e-3)
  assert lp.token_logprobs[len(prompt_ids):] == pytest.approx(
      choice.logprobs.token_logprobs, abs=2e-3)
  for tok, top, own in zip(lp.tokens[1:], lp.top_logprobs[1:], lp.token_logprobs[1:]):
    assert top[tok] == own and max(top.values()) >= own
  with pytest.raises(openai.BadRequestError, match="max_tokens = 0 needs echo"):
    client.completions.create(model="bat-tiny", prompt="x", max_tokens=0)


SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "count", "ok", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["a", "b"]}}}


def _valid(doc) -> bool:
  return (isinstance(doc, dict) and set(doc) == set(SCHEMA["required"])
          and isinstance(doc["name"], str) and len(doc["name"]) <= 6
          and type(doc["count"]) is int and 0 <= doc["count"] <= 99
          and isinstance(doc["ok"], bool) and doc["kind"] in ("a", "b"))


def test_json_schema_response_format_parses_and_validates_for_20_seeds(served):
  client = _client(served[1])
  fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
  for seed in range(20):
    out = client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=120,
                                         temperature=1.0, seed=seed, response_format=fmt)
    [choice] = out.choices
    assert choice.finish_reason == "stop", (seed, choice.message.content)
    assert _valid(json.loads(choice.message.content)), (seed, choice.message.content)
  obj = client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=40, seed=3,
                                       response_format={"type": "json_object"})
  text = obj.choices[0].message.content
  assert text.startswith("{")
  if obj.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(text), dict)
  with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema"):
    client.chat.completions.create(model="bat-tiny", messages=USER, max_tokens=2,
                                   response_format={"type": "json_schema", "json_schema": {
                                       "name": "x", "schema": {"type": "bogus"}}})


def test_sglang_json_schema_and_regex(served):
  base = served[1]
  r = httpx.post(base + "/generate", timeout=60, json={
      "text": "List", "sampling_params": {"max_new_tokens": 12, "regex": "[0-9]{3}-[ab]",
                                          "temperature": 1.0}})
  assert r.status_code == 200, r.text
  import re
  assert re.fullmatch(r"[0-9]{3}-[ab]", r.json()["text"]), r.json()["text"]
