"""Adversarial HTTP input against `bat_jax.rollout.server`: every junk request gets a 4xx within a second
(a stalled body: within its 0.5 s read timeout plus a margin), the server keeps serving, and its
process stays under 2 GB RSS."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

GEN, CHAT = "/generate", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def post(path: str, body: bytes, *, headers: str = "", length: int | None = None) -> bytes:
  n = len(body) if length is None else length
  cl = "" if length == -1 else f"Content-Length: {n}\r\n"
  return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{cl}{headers}"
          f"\r\n").encode() + body


def js(path: str, obj) -> bytes:
  return post(path, json.dumps(obj).encode())


def gen_sp(**sp) -> bytes:
  return js(GEN, {"input_ids": [1, 2], "sampling_params": sp})


def chat(**fields) -> bytes:
  return js(CHAT, {"messages": USER, "max_tokens": 2, **fields})


def deep_schema_chat(n: int) -> bytes:
  """A chat request whose tool schema nests n objects deep (too deep for json.dumps here)."""
  schema = '{"type":"object","properties":{"a":' * n + '{"type":"object"}' + "}}" * n
  return post(CHAT, ('{"messages":[{"role":"user","content":"x"}],"max_tokens":1,"tools":'
                     '[{"type":"function","function":{"name":"f","parameters":' + schema +
                     "}}]}").encode())


# (name, raw request, allowed statuses). Bodies are built once at import: cheap.
ATTACKS = [
    ("nested-100k-brackets", post(GEN, b"[" * 100_000), {400}),
    ("nested-100k-objects", post(GEN, b'{"a":' * 100_000), {400}),
    ("content-length-abc", post(GEN, b"{}", headers="Content-Length: abc\r\n", length=-1),
     {400}),
    ("content-length-negative", post(GEN, b"{}", headers="Content-Length: -5\r\n",
                                     length=-1), {400}),
    ("content-length-underscore", post(GEN, b"{}", headers="Content-Length: 1_0\r\n",
                                       length=-1), {400}),
    ("content-length-twice", post(GEN, b"{}", headers="Content-Length: 2\r\n"), {400}),
    ("chunked-body", post(GEN, b"2\r\n{}\r\n0\r\n\r\n",
                          headers="Transfer-Encoding: chunked\r\n", length=-1), {411}),
    ("63MB-declared", post(GEN, b'{"text": "' + b"a" * 1_000_000, length=63 << 20), {413}),
    ("short-body-stalls", post(GEN, b'{"input_ids": [1', length=100), {408}),
    ("invalid-utf8", post(GEN, b'{"text": "\xff\xfe\xfa"}'), {400}),
    ("body-is-array", js(GEN, [1, 2]), {400}),
    ("body-is-string", js(GEN, "generate"), {400}),
    ("temperature-Infinity", post(GEN, b'{"input_ids":[1],"sampling_params":'
                                       b'{"temperature": Infinity}}'), {400}),
    ("temperature-NaN", post(GEN, b'{"input_ids":[1],"sampling_params":{"temperature": NaN}}'),
     {400}),
    ("temperature-1e400", post(GEN, b'{"input_ids":[1],"sampling_params":'
                                    b'{"temperature": 1e400}}'), {400}),
    ("temperature-string", gen_sp(temperature="hot"), {400}),
    ("top_p-zero", gen_sp(top_p=0), {400}),
    ("stop_token_ids-1e12", post(GEN, b'{"input_ids":[1],"sampling_params":'
                                      b'{"stop_token_ids":[1e12]}}'), {400}),
    ("stop_token_ids-huge-int", gen_sp(stop_token_ids=[10 ** 30]), {400}),
    ("stop_token_ids-negative", gen_sp(stop_token_ids=[-1]), {400}),
    ("stop_token_ids-bool", gen_sp(stop_token_ids=[True]), {400}),
    ("stop_token_ids-too-many", gen_sp(stop_token_ids=list(range(50))), {400}),
    ("5000-digit-int", post(GEN, b'{"input_ids":[' + b"9" * 5000 + b"]}"), {400}),
    ("max_new_tokens-negative", gen_sp(max_new_tokens=-1), {400}),
    ("max_new_tokens-float", gen_sp(max_new_tokens=2.5), {400}),
    ("n-million", gen_sp(n=10 ** 6), {400}),
    ("stop-1000-strings", gen_sp(stop=["x"] * 1000), {400}),
    ("stop-10k-chars", gen_sp(stop="x" * 10_000), {400}),
    ("sampling_params-list", js(GEN, {"input_ids": [1], "sampling_params": [{}]}), {400}),
    ("input_ids-empty", js(GEN, {"input_ids": []}), {400}),
    ("input_ids-nested-empty", js(GEN, {"input_ids": [[]]}), {400}),
    ("input_ids-out-of-vocab", js(GEN, {"input_ids": [10 ** 9]}), {400}),
    ("input_ids-300-prompts", js(GEN, {"input_ids": [[1]] * 300}), {400}),
    ("text-too-long", js(GEN, {"text": "a" * 3_000_000}), {400}),
    ("rid-object", js(GEN, {"input_ids": [1], "rid": {"a": 1}}), {400}),
    ("logprob_start_len", js(GEN, {"input_ids": [1], "logprob_start_len": 0}), {400}),
    ("top_logprobs_num-999", js(GEN, {"input_ids": [1], "return_logprob": True,
                                      "top_logprobs_num": 999}), {400}),
    ("tools-string", chat(tools="all"), {400}),
    ("tools-no-function", chat(tools=[{"type": "function"}]), {400}),
    ("tools-name-int", chat(tools=[{"type": "function", "function": {"name": 5}}]), {400}),
    ("tools-properties-list", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": []}}}]), {400}),
    ("tools-200", chat(tools=[{"type": "function", "function": {"name": f"f{i}"}}
                              for i in range(200)]), {400}),
    ("tools-deep-schema", deep_schema_chat(450), {400}),   # over MAX_SCHEMA_DEPTH, checked first
    ("tools-deeper-schema", deep_schema_chat(5000), {400}),
    ("tool_choice-unknown", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                 tool_choice={"type": "function",
                                              "function": {"name": "nope"}}), {400}),
    ("tool_choice-without-tools", chat(tool_choice="auto"), {400}),
    ("messages-image-part", js(CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), {400}),
    ("messages-not-list", js(CHAT, {"messages": {"role": "user"}}), {400}),
    ("messages-10k-turns", js(CHAT, {"messages": USER * 10_000, "max_tokens": 1}), {400}),
    ("chat-logprobs-string", chat(logprobs="yes"), {400}),
    ("chat-top_logprobs-50", chat(logprobs=True, top_logprobs=50), {400}),
    ("chat-temperature-Infinity", post(CHAT, b'{"messages":[{"role":"user","content":"x"}],'
                                             b'"temperature": -Infinity}'), {400}),
    ("chat-model-object", chat(model={"x": 1}), {404}),
    ("chat-response_format-bad-type", chat(response_format={"type": "xml"}), {400}),
    ("chat-json_schema-not-object", chat(response_format={"type": "json_schema",
                                                          "json_schema": {"schema": 5}}), {400}),
    ("text-lone-surrogate", post(GEN, b'{"text": "ab\\ud800cd"}'), {400}),
    ("chat-lone-surrogate", post(CHAT, b'{"messages":[{"role":"user","content":"\\udc00"}]}'),
     {400}),
    ("chat-stream_options-junk", chat(stream=True, stream_options={"x": 1}), {400}),
    ("release-bad-tags", js("/release_memory_occupation", {"tags": "all"}), {400}),
    ("update-weights-no-path", js("/update_weights_from_disk", {"model_path": 5}), {400}),
    ("method-PUT", b"PUT /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", {405}),
    ("method-DELETE", b"DELETE /health HTTP/1.1\r\nHost: x\r\n\r\n", {405}),
    ("unknown-path", b"GET /admin HTTP/1.1\r\nHost: x\r\n\r\n", {404}),
    ("garbage-request-line", b"HELLO\r\n\r\n", {400}),
    ("header-70k", b"GET /health HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", {400, 431}),
]


def send(base: str, raw: bytes, timeout: float = 10.0) -> tuple[int, float]:
  """Sends raw bytes; returns (HTTP status, seconds until the status line arrived)."""
  url = urlparse(base)
  t0 = time.perf_counter()
  with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
    try:
      sock.sendall(raw)
    except (BrokenPipeError, ConnectionResetError):
      pass  # the server answered (413) and closed before the rest was sent
    data = b""
    while b"\r\n" not in data:
      try:
        piece = sock.recv(4096)
      except ConnectionResetError:
        break
      if not piece:
        break
      data += piece
  elapsed = time.perf_counter() - t0
  return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0, elapsed


def rss_mb() -> float:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_junk_gets_a_4xx_within_a_second_and_memory_stays_bounded(served):
  _, base = served
  assert httpx.get(f"{base}/health").status_code == 200
  # The server runs in this worker, whose RSS also holds earlier tests' state: bound the growth.
  rss_before = rss_mb()
  results = []
  for name, raw, allowed in ATTACKS:
    status, elapsed = send(base, raw)
    limit = 0.5 + 1.0 if name == "short-body-stalls" else 1.0
    results.append((name, status, elapsed, status in allowed and elapsed < limit))
  failed = [r for r in results if not r[3]]
  print(f"\nHTTP attacks handled: {len(results) - len(failed)}/{len(results)}; "
        f"slowest {max(r[2] for r in results):.2f}s; RSS {rss_mb():.0f} MB")
  assert not failed, failed
  assert httpx.get(f"{base}/health").status_code == 200
  out = httpx.post(f"{base}/generate", json={"input_ids": [1, 2],
                                            "sampling_params": {"max_new_tokens": 2}}, timeout=120)
  assert out.status_code == 200
  assert rss_mb() - rss_before < 512, (rss_before, rss_mb())


@pytest.mark.parametrize("header", ["Content-Length: abc", "Content-Length: -5"])
def test_bad_content_length_names_the_header(served, header):
  _, base = served
  url = urlparse(base)
  with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
    sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\n{header}\r\n\r\n{{}}".encode())
    reply = b""
    while piece := sock.recv(65536):  # the server closes after a bad Content-Length
      reply += piece
    reply = reply.decode()
  assert reply.startswith("HTTP/1.1 400") and "Content-Length must be one" in reply


def test_hundreds_of_stalled_clients_cannot_starve_health_or_generate(served):
  """300 loopback sockets that send nothing or half a header hold no worker (there are 64):
  /health and /generate still answer within a bound."""
  app, base = served
  url = urlparse(base)
  generate = js(GEN, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
  assert send(base, generate, timeout=300)[0] == 200   # compiled before the clock starts
  stalled = []
  try:
    for i in range(300):
      sock = socket.create_connection((url.hostname, url.port), timeout=10)
      if i % 2:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le")
      stalled.append(sock)
    t0 = time.perf_counter()
    for _ in range(3):
      status, _ = send(base, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
      assert status == 200
    assert send(base, generate)[0] == 200
    assert time.perf_counter() - t0 < 10.0
  finally:
    for sock in stalled:
      sock.close()


def test_stalled_headers_get_408_after_the_deadline(model, tokenizer, chat):
  from serve_fixtures import ENGINE
  from flax import nnx
  from bat_jax.rollout import server as serve
  from bat_jax.rollout.jax_engine import JaxEngine
  served = serve.ServedModel(engine=JaxEngine(model, ENGINE), model_path="/ckpt/x",
                             load=lambda p: None, tokenizer=tokenizer, chat_format=chat,
                             graphdef=nnx.split(model)[0])
  app = serve.ServeApp(served)
  httpd, base = serve.serve_in_thread(app, header_timeout_s=0.5, max_connections=2)
  try:
    url = urlparse(base)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
      t0 = time.perf_counter()
      sock.sendall(b"GET /health HTTP/1.1\r\nHo")
      data = sock.recv(4096)
      assert data.startswith(b"HTTP/1.1 408") and time.perf_counter() - t0 < 3.0
    # Keep-alive still works: two requests on one connection.
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
      for _ in range(2):
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while not reply.endswith(b"}"):  # headers and body may come in separate packets
          reply += sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200") and b'"ok"' in reply, reply
  finally:
    httpd.shutdown()
    httpd.server_close()
    app.close()


def test_a_schema_nested_past_the_limit_is_refused_by_name():
  """Tool parameters and response-format schemas share one depth limit, checked before any
  recursive rendering, serialising or grammar building."""
  from bat_jax.rollout.server import openai_api as api
  from bat_jax.rollout.server import params as P
  from bat_jax.rollout.server.grammar import response_format_grammar
  from bat_jax.rollout.server.params import RequestError
  assert P.nesting({"a": [1, {"b": 2}]}) == 3 and P.nesting(7) == 0

  def params(depth):   # a schema that nests exactly `depth` levels
    chain = {}
    for _ in range(depth - 3):
      chain = {"a": chain}
    return {"type": "object", "properties": {"a": chain}}
  tool = lambda depth: {"type": "function", "function": {"name": "f", "parameters": params(depth)}}
  assert P.nesting(params(P.MAX_SCHEMA_DEPTH)) == P.MAX_SCHEMA_DEPTH
  api._check_tool(tool(P.MAX_SCHEMA_DEPTH), "tools[0]")
  with pytest.raises(RequestError, match=r"tools\[0\].function.parameters nests deeper than 64"):
    api._check_tool(tool(P.MAX_SCHEMA_DEPTH + 1), "tools[0]")
  deep = {"type": "json_schema", "json_schema": {"name": "x",
                                                 "schema": params(P.MAX_SCHEMA_DEPTH + 1)}}
  with pytest.raises(RequestError, match=r"response_format.json_schema.schema nests deeper"):
    response_format_grammar(deep)
