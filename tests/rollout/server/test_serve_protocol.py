"""`bat_jax.rollout.server`: request validation, SGLang/OpenAI answers, and the CLI under the launcher."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from bat_jax import workflow
from bat_jax.model import save_pretrained
from bat_jax.rollout import server as serve
from bat_jax.rollout.openai_chat import assistant_turn
from bat_jax.rollout.sglang_launcher import ServerProcess, free_port

from serve_fixtures import MAX_LEN, start, stop


@pytest.fixture(scope="module")
def url(model, tokenizer, chat):
  app, httpd, base = start(model, tokenizer, chat)
  yield base
  stop(app, httpd)


BAD_REQUESTS = [
    ("POST", "/generate", b"{not json", 400, "not valid JSON"),
    ("POST", "/generate", {}, 400, "exactly one of input_ids or text"),
    ("POST", "/generate", {"input_ids": [1, "a"]}, 400, "input_ids must be a list of integer"),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}, 400,
     "sampling_params.temperature"),
    ("POST", "/generate", {"input_ids": [1], "sampling_params": {"top_q": 1}}, 400,
     "does not accept field(s) ['top_q']"),
    ("POST", "/generate", {"input_ids": [1], "priority": 1}, 400,
     "does not accept field(s) ['priority']"),
    ("POST", "/generate", {"input_ids": [1] * MAX_LEN}, 400,
     f"input_ids has {MAX_LEN} tokens"),
    ("POST", "/generate", {"input_ids": [[1], [2] * MAX_LEN]}, 400,
     f"input_ids[1] has {MAX_LEN} tokens"),
    ("POST", "/generate", {"input_ids": [10 ** 6]}, 400, "outside [0,"),
    ("POST", "/generate", {"input_ids": [1], "stream": True}, 400, "stream = true"),
    ("POST", "/generate", {"input_ids": [1], "rid": ["a", "b"]}, 400, "rid must be a string"),
    ("POST", "/generate", {"input_ids": [[1], [2]], "rid": ["a"]}, 400, "rid must be one string per prompt"),
    ("GET", "/v2/generate", None, 404, "unknown endpoint GET /v2/generate"),
    ("POST", "/update_weights_from_disk", {}, 400, "model_path must be a non-empty string"),
    ("POST", "/update_weights_from_disk", {"model_path": "/no/such/ckpt"}, 400,
     "model_path '/no/such/ckpt' is not a directory"),
    ("POST", "/v1/chat/completions", {"model": "gpt-9", "messages": [
        {"role": "user", "content": "hi"}]}, 404, "unknown model 'gpt-9'"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role = 'robot'"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0},
     400, "n = 0"),
    ("POST", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "execute_code",
                                                           "arguments": "{bad"}}]}]}, 400,
     "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 20000}]},
     400, "messages has"),
]


@pytest.mark.parametrize("method, path, body, status, message", BAD_REQUESTS,
                         ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_requests_are_refused_naming_the_field(url, method, path, body, status, message):
  content = body if isinstance(body, bytes) else (json.dumps(body) if body is not None else None)
  resp = httpx.request(method, url + path, content=content, timeout=60)
  assert resp.status_code == status
  assert message in resp.json()["error"]["message"]


def test_generate_text_batch_and_logprob_entries(url, tokenizer):
  body = {"text": ["plan the stage", "run the case"], "return_logprob": True,
          "return_text_in_logprobs": True,
          "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
  answers = httpx.post(f"{url}/generate", json=body, timeout=60).json()
  assert isinstance(answers, list), answers
  assert len(answers) == 2
  for a in answers:
    meta = a["meta_info"]
    assert meta["completion_tokens"] == 4 and meta["finish_reason"]["type"] == "length"
    assert [e[1] for e in meta["output_token_logprobs"]] == a["output_ids"]
    assert all(e[0] <= 0 and isinstance(e[2], str) for e in meta["output_token_logprobs"])
    assert a["text"] == tokenizer.decode(a["output_ids"], skip_special_tokens=True)
  info = httpx.get(f"{url}/get_model_info").json()
  assert info["model_path"] == "/ckpt/tiny-policy" and info["max_total_tokens"] == MAX_LEN
  assert httpx.get(f"{url}/health").status_code == 200
  assert httpx.post(f"{url}/flush_cache").json()["success"] is True


def test_chat_completions_with_tools_answers_openai_shape(url):
  messages = [
      {"role": "system", "content": "You are a research agent."},
      {"role": "user", "content": "List the data."},
      {"role": "assistant", "content": None, "tool_calls": [{
          "id": "call_1", "type": "function", "function": {
              "name": "execute_code",
              "arguments": json.dumps({"language": "bash", "code": "ls data"})}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "exit_code=0\nstdout:a.pgm\nstderr:"},
  ]
  resp = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
      "model": "tiny-policy", "messages": messages, "tools": [workflow.TOOL_SCHEMA],
      "max_tokens": 5, "temperature": 0})
  assert resp.status_code == 200, resp.text
  out = resp.json()
  choice = out["choices"][0]
  assert out["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
  assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 5
  assert out["usage"]["prompt_tokens"] > 20


def test_assistant_turn_returns_parsed_tool_calls(chat, tokenizer):
  action = {"name": workflow.TOOL_NAME, "thought": "Check the inputs.",
            "arguments": {"language": "python", "code": "print(open('task/spec.json').read())"}}
  ids = chat.encode_action(action)
  message, finish = assistant_turn(chat.decode(ids), tokenizer.decode(ids), chat,
                                   parse_tools=True, cut_at_length=False)
  assert finish == "tool_calls"
  [call] = message["tool_calls"]
  assert call["function"]["name"] == workflow.TOOL_NAME
  assert json.loads(call["function"]["arguments"]) == action["arguments"]
  assert message["content"] == "Check the inputs."
  # The same text with a broken call comes back as text, finish "stop".
  broken = chat.decode(ids).replace("</function>", "")
  message, finish = assistant_turn(broken, broken, chat, parse_tools=True, cut_at_length=False)
  assert finish == "stop" and "tool_calls" not in message and message["content"] == broken


def test_cli_refuses_a_missing_checkpoint(capsys):
  with pytest.raises(SystemExit) as exit_info:
    serve.main(["--checkpoint=/no/such/dir", "--port=1"])
  assert exit_info.value.code == 2
  assert "--model-path '/no/such/dir' is not a directory" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    serve.main(["--model-path=.", "--tp-size=2"])
  assert "--tp-size 2: bat_jax.serve runs one engine" in capsys.readouterr().err


def test_cli_serves_a_checkpoint_under_the_launcher(model, tokenizer_dir, tmp_path):
  ckpt = tmp_path / "ckpt"
  save_pretrained(model, ckpt, tokenizer_dir=tokenizer_dir)
  port = free_port()
  # The flags the rollout launcher gives sglang.launch_server, plus our own.
  cmd = [sys.executable, "-m", "bat_jax.serve", "--model-path", str(ckpt), "--host",
         "127.0.0.1", "--port", str(port), "--dtype", "float32", "--mem-fraction-static", "0.8",
         "--tp-size", "1", "--context-length", "1024", "--random-seed", "3",
         "--enable-memory-saver", "--served-model-name", "policy-x", "--num-slots=2",
         "--weight-version=ckpt-0"]
  with ServerProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "serve.log",
                     startup_timeout_s=180) as server:
    base = server.base_url
    info = httpx.get(f"{base}/get_model_info").json()
    assert info["weight_version"] == "ckpt-0" and info["model_path"] == str(ckpt)
    assert info["has_chat"] is True and info["max_total_tokens"] == 1024
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "policy-x"
    out = httpx.post(f"{base}/generate", timeout=120, json={
        "input_ids": [3, 4, 5], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}).json()
    assert len(out["meta_info"]["output_token_logprobs"]) == 3
    pgid = server.pid
  from tests.rollout.process_checks import group_alive
  assert not group_alive(pgid)
