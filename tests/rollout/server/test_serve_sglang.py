"""`bat_jax.rollout.server` as an SGLang 0.5.23 stand-in: /generate sampling params, info, memory."""

from __future__ import annotations

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

from serve_fixtures import path_map, set_bigram_path, start, stop, tiny_model


@pytest.fixture(scope="module")
def bigram(tokenizer, chat):
  """A server whose model answers `</function></tool_call><|im_end|>` after a newline."""
  model = tiny_model(len(tokenizer))
  newline = chat.encode("\n")
  answer = chat.encode("</function></tool_call>") + [chat.im_end_id]
  set_bigram_path(model, path_map([newline + answer]))
  app, httpd, base = start(model, tokenizer, chat)
  yield base, newline, answer
  stop(app, httpd)


def gen(base, **body):
  resp = httpx.post(f"{base}/generate", json=body, timeout=120)
  assert resp.status_code == 200, resp.text
  return resp.json()


def test_stop_strings_trim_and_no_stop_trim(bigram):
  base, newline, answer = bigram
  sp = {"max_new_tokens": 10, "temperature": 0, "stop": "</tool_call>"}
  out = gen(base, input_ids=newline, sampling_params=sp)
  assert out["output_ids"] == answer[:-1]           # ends with the completing token
  assert out["text"] == "</function>"
  assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "</tool_call>"}
  kept = gen(base, input_ids=newline, sampling_params={**sp, "no_stop_trim": True})
  assert kept["text"] == "</function></tool_call>"


def test_stop_token_ids_eos_and_ignore_eos(bigram, chat):
  base, newline, answer = bigram
  out = gen(base, input_ids=newline, sampling_params={
      "max_new_tokens": 10, "temperature": 0, "stop_token_ids": [answer[1]]})
  assert out["output_ids"] == answer[:2] and out["text"] == "</"
  assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": answer[1]}
  eos = gen(base, input_ids=newline, sampling_params={"max_new_tokens": 10, "temperature": 0})
  assert eos["output_ids"] == answer            # the tokenizer's EOS (<|im_end|>) stops it
  assert eos["meta_info"]["finish_reason"]["matched"] == chat.im_end_id
  more = gen(base, input_ids=newline, sampling_params={
      "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
  assert more["output_ids"][:5] == answer and len(more["output_ids"]) == 8
  assert more["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_skip_special_tokens(bigram):
  base, newline, _ = bigram
  sp = {"max_new_tokens": 10, "temperature": 0, "no_stop_trim": True}
  assert gen(base, input_ids=newline, sampling_params=sp)["text"] == "</function></tool_call>"
  raw = gen(base, input_ids=newline, sampling_params={**sp, "skip_special_tokens": False})
  assert raw["text"] == "</function></tool_call><|im_end|>"


def test_n_samples_and_top_k_minus_one(served):
  _, base = served
  outs = gen(base, input_ids=[5, 6, 7], rid="r", sampling_params={
      "n": 3, "max_new_tokens": 4, "top_k": -1, "temperature": 1.0, "ignore_eos": True})
  assert [o["meta_info"]["id"] for o in outs] == ["r_0", "r_1", "r_2"]
  assert all(len(o["output_ids"]) == 4 for o in outs)
  batch = gen(base, input_ids=[[5, 6], [7, 8]], sampling_params={"n": 2, "max_new_tokens": 2})
  assert len(batch) == 4
  empty = gen(base, input_ids=[5], sampling_params={"max_new_tokens": 0})
  assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"]["type"] == "length"


def test_min_p_one_is_greedy(served):
  _, base = served
  greedy = gen(base, input_ids=[9, 10, 11], sampling_params={
      "max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
  min_p = gen(base, input_ids=[9, 10, 11], sampling_params={
      "max_new_tokens": 12, "temperature": 1.0, "min_p": 1.0, "ignore_eos": True})
  assert min_p["output_ids"] == greedy["output_ids"]


def reference_logprobs(model, prompt, output, temperature) -> np.ndarray:
  """[N, V] log softmax(logits / T) at each output position, from a full forward pass."""
  logits = np.asarray(jax.jit(lambda x: model(x))(np.asarray([prompt + output], np.int32)))[0]
  return np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:-1] / temperature, axis=-1))


def test_min_p_keeps_only_tokens_near_the_top(served, model):
  _, base = served
  outs = gen(base, input_ids=[7, 8, 9], sampling_params={
      "n": 4, "max_new_tokens": 10, "temperature": 1.0, "min_p": 0.9, "ignore_eos": True})
  for out in outs:
    ref = reference_logprobs(model, [7, 8, 9], out["output_ids"], 1.0)
    ratio = [ref[i, t] - ref[i].max() for i, t in enumerate(out["output_ids"])]
    assert min(ratio) >= np.log(0.9) - 1e-4  # p(token) >= min_p * p(top token)


def test_logprobs_are_of_the_temperature_scaled_distribution(served, model):
  _, base = served
  prompt = [3, 4, 5, 6]
  out = gen(base, input_ids=prompt, return_logprob=True, top_logprobs_num=3,
            return_text_in_logprobs=True,
            sampling_params={"max_new_tokens": 6, "temperature": 0.7, "ignore_eos": True})
  ref = reference_logprobs(model, prompt, out["output_ids"], 0.7)
  meta = out["meta_info"]
  for i, (lp, tok, text) in enumerate(meta["output_token_logprobs"]):
    assert tok == out["output_ids"][i] and isinstance(text, str)
    assert lp == pytest.approx(float(ref[i, tok]), abs=1e-4)
    top = meta["output_top_logprobs"][i]
    assert [t for _, t, _ in top] == list(np.argsort(-ref[i])[:3])
    assert [v for v, _, _ in top] == pytest.approx(np.sort(ref[i])[::-1][:3], abs=1e-4)


def test_model_info_alias_and_refusals(served):
  _, base = served
  info = httpx.get(f"{base}/model_info").json()
  assert info == httpx.get(f"{base}/get_model_info").json()
  assert info["served_model_name"] == "bat-tiny" and info["max_total_tokens"] == 2048
  for sp, message in [
      ({"top_k": 0}, "top_k = 0 is invalid"),
      ({"frequency_penalty": 0.5}, "frequency_penalty = 0.5 is not supported"),
      ({"ebnf": "root ::= 'a'"}, "ebnf = \"root ::= 'a'\" is not supported"),
      ({"regex": "a+", "json_schema": "{}"}, "at most one of json_schema, regex"),
      ({"regex": "(unclosed"}, "sampling_params.regex is not a usable grammar"),
      ({"json_schema": "{not json"}, "sampling_params.json_schema is not valid JSON"),
      ({"temperature": 1e300 * 10}, "temperature"),
      ({"min_p": 1.5}, "sampling_params.min_p = 1.5"),
      ({"n": 0}, "sampling_params.n = 0"),
      ({"stop": [""]}, "sampling_params.stop[0]"),
      ({"best_of": 2}, "field(s) ['best_of']")]:
    resp = httpx.post(f"{base}/generate", json={"input_ids": [1], "sampling_params": sp})
    assert resp.status_code == 400 and message in resp.json()["error"]["message"], sp
  ok = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
        "spaces_between_special_tokens": True, "max_new_tokens": 1, "stream_interval": 4}
  assert httpx.post(f"{base}/generate", json={"input_ids": [1], "sampling_params": ok}
                    ).status_code == 200


def test_release_and_resume_memory_occupation(model, tokenizer, chat):
  app, httpd, base = start(model, tokenizer, chat)
  try:
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                        "ignore_eos": True}}
    before = gen(base, **body)["output_ids"]
    live = lambda: sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())  # noqa: E731
    held = live()
    resp = httpx.post(f"{base}/release_memory_occupation", json={"tags": None}, timeout=60)
    assert resp.status_code == 200 and resp.json()["released"] == ["kv_cache", "weights"]
    freed = held - live()
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert freed >= params_bytes  # weights and cache left the device
    refused = httpx.post(f"{base}/generate", json=body, timeout=60)
    assert refused.status_code == 503 and "resume_memory_occupation" in refused.text
    bad = httpx.post(f"{base}/resume_memory_occupation", json={"tags": ["gpu"]})
    assert bad.status_code == 400 and "tags must be a list of" in bad.text
    resp = httpx.post(f"{base}/resume_memory_occupation", json={}, timeout=120)
    assert resp.status_code == 200 and resp.json()["released"] == []
    assert gen(base, **body)["output_ids"] == before
    # verl's order: release all, resume weights (then sync them), then the KV cache.
    for tags, left in [(None, ["kv_cache", "weights"]), (["weights"], ["kv_cache"]),
                       (["kv_cache"], [])]:
      what = "release" if tags is None else "resume"
      resp = httpx.post(f"{base}/{what}_memory_occupation", json={"tags": tags}, timeout=120)
      assert resp.json()["released"] == left
    assert gen(base, **body)["output_ids"] == before
    for tag in ("kv_cache", "weights"):  # each alone
      for what in ("release", "resume"):
        resp = httpx.post(f"{base}/{what}_memory_occupation", json={"tags": [tag]}, timeout=120)
        assert resp.status_code == 200, resp.text
      assert gen(base, **body)["output_ids"] == before
  finally:
    stop(app, httpd)
