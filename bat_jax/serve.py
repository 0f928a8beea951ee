"""HTTP server over the in-process JAX engine, speaking the SGLang subset and OpenAI chat.

    python -m bat_jax.serve --checkpoint=DIR --port=P

Endpoints:
  GET  /health, /health_generate       200 when the server is up.
  GET  /get_model_info                 model_path, tokenizer_path, weight_version, limits.
  GET  /get_weight_version             {"weight_version": ...}.
  POST /generate                       SGLang: input_ids (or text), sampling_params,
                                       return_logprob, rid; single or batched.
  POST /update_weights_from_disk       {model_path, flush_cache, weight_version}.
  POST /flush_cache                    drops every cached conversation.
  POST /v1/chat/completions            OpenAI-compatible chat with tools (non-streaming).

It lets the SGLang client path run end to end on a CPU and lets external harnesses drive the
policy. Bad requests get a 4xx whose JSON `error.message` names the field at fault. Concurrent
requests are batched by an `EngineWorker`; the stdlib ThreadingHTTPServer is enough for that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from bat_jax.rollout.engine import Completion, GenerateRequest, SamplingParams
from bat_jax.rollout.jax_engine import JaxEngine, JaxEngineConfig
from bat_jax.rollout.openai_chat import chat_answer, openai_to_messages
from bat_jax.rollout.worker import EngineWorker

log = logging.getLogger("bat_jax.serve")

MAX_BODY_BYTES = 64 << 20
_GENERATE_FIELDS = frozenset({"input_ids", "text", "sampling_params", "return_logprob", "rid",
                              "stream", "logprob_start_len", "return_text_in_logprobs",
                              "top_logprobs_num"})
_CHAT_FIELDS = frozenset({"model", "messages", "tools", "tool_choice", "max_tokens",
                          "max_completion_tokens", "temperature", "top_p", "top_k", "n",
                          "stream", "seed", "user", "parallel_tool_calls"})


class RequestError(Exception):
  """A client error: HTTP `status` with a message that names the field at fault."""

  def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST):
    super().__init__(message)
    self.status = int(status)


@dataclasses.dataclass
class ServedModel:
  """What the server answers with; `load` turns a checkpoint dir into an nnx model."""
  engine: JaxEngine
  model_path: str
  load: Callable[[str], Any]
  tokenizer: Any = None        # transformers tokenizer, or None (then no text / chat)
  chat_format: Any = None      # bat_jax.model.tokenizer.ChatFormat, or None
  default_max_new_tokens: int = 256


class ServeApp:
  """Request routing and validation; transport-free so it is easy to reason about."""

  def __init__(self, served: ServedModel, *, max_batch: Optional[int] = None):
    self.served = served
    self.worker = EngineWorker(served.engine,
                               max_batch=max_batch or served.engine.config.num_slots)
    self._routes = {
        ("GET", "/health"): lambda _: {"status": "ok"},
        ("GET", "/health_generate"): lambda _: {"status": "ok"},
        ("GET", "/get_model_info"): self.model_info,
        ("GET", "/get_weight_version"):
            lambda _: {"weight_version": self.served.engine.weight_version},
        ("POST", "/generate"): self.generate,
        ("POST", "/update_weights_from_disk"): self.update_weights_from_disk,
        ("POST", "/flush_cache"): self.flush_cache,
        ("POST", "/v1/chat/completions"): self.chat_completions,
    }

  def close(self) -> None:
    self.worker.close()

  def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
    """Returns (status, JSON-able answer) for one request."""
    route = self._routes.get((method, path.split("?", 1)[0]))
    if route is None:
      known = sorted(p for m, p in self._routes if m == method)
      return 404, _error(f"unknown endpoint {method} {path}; {method} serves {known}")
    try:
      return 200, route(body)
    except RequestError as e:
      return e.status, _error(str(e))
    except ValueError as e:  # engine-side checks: PromptTooLongError, token ids, stop ids
      return 400, _error(str(e))

  # -- endpoints ------------------------------------------------------------------------------

  def model_info(self, _body) -> dict:
    engine = self.served.engine
    return {"model_path": self.served.model_path, "tokenizer_path": self.served.model_path,
            "is_generation": True, "weight_version": engine.weight_version,
            "max_total_tokens": engine.config.max_len, "max_running_requests":
            engine.config.num_slots, "has_chat": self.served.chat_format is not None}

  def generate(self, body: Any) -> Any:
    body = _object(body, "request body")
    _no_unknown(body, _GENERATE_FIELDS, "/generate")
    if body.get("stream"):
      raise RequestError("stream = true is not supported by bat_jax.serve")
    prompts, batched = self._prompts(body)
    try:
      sampling = SamplingParams.from_dict(
          body.get("sampling_params") or {},
          default_max_new_tokens=self.served.default_max_new_tokens)
    except (ValueError, TypeError) as e:
      raise RequestError(str(e)) from e
    rids = body.get("rid")
    if rids is None:
      rids = [uuid.uuid4().hex for _ in prompts]
    elif not batched:
      if not isinstance(rids, str):
        raise RequestError(f"rid must be a string for a single prompt, got {rids!r}")
      rids = [rids]
    if not isinstance(rids, list) or len(rids) != len(prompts):
      raise RequestError(f"rid must be one id per prompt ({len(prompts)}), got {rids!r}")
    for i, ids in enumerate(prompts):
      self.served.engine.check_prompt(ids, "input_ids" if not batched else f"input_ids[{i}]")
    with_logprob = bool(body.get("return_logprob", False))
    completions = self.worker.generate_many([GenerateRequest(ids, sampling) for ids in prompts])
    answers = [self._generate_answer(c, rid, with_logprob, sampling)
               for c, rid in zip(completions, rids)]
    return answers if batched else answers[0]

  def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
    """input_ids (or text, tokenised) as a list of prompts, and whether it was a batch."""
    if ("input_ids" in body) == ("text" in body):
      raise RequestError("/generate needs exactly one of input_ids or text")
    if "text" in body:
      tok = self._need_tokenizer("text")
      texts = body["text"]
      batched = isinstance(texts, list)
      texts = texts if batched else [texts]
      if not all(isinstance(t, str) for t in texts):
        raise RequestError("text must be a string or a list of strings")
      return [tok.encode(t, add_special_tokens=False) for t in texts], batched
    ids = body["input_ids"]
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    for i, p in enumerate(prompts):
      name = f"input_ids[{i}]" if batched else "input_ids"
      if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in p):
        raise RequestError(f"{name} must be a list of integer token ids")
    return prompts, batched

  def _generate_answer(self, c: Completion, rid: str, with_logprob: bool,
                       sampling: SamplingParams) -> dict:
    tok = self.served.tokenizer
    finish: dict[str, Any] = {"type": c.finish_reason}
    if c.finish_reason == "stop" and c.output_ids:
      finish["matched"] = c.output_ids[-1]
    elif c.finish_reason == "length":
      finish["length"] = sampling.max_new_tokens
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": c.prompt_tokens,
            "completion_tokens": len(c.output_ids), "cached_tokens": c.cached_tokens,
            "weight_version": c.weight_version}
    if with_logprob:
      meta["output_token_logprobs"] = [
          [lp, t, tok.decode([t]) if tok is not None else None]
          for lp, t in zip(c.logprobs, c.output_ids)]
    text = tok.decode(list(c.output_ids)) if tok is not None else ""
    return {"text": text, "output_ids": list(c.output_ids), "meta_info": meta}

  def update_weights_from_disk(self, body: Any) -> dict:
    body = _object(body, "request body")
    _no_unknown(body, {"model_path", "flush_cache", "weight_version", "load_format",
                       "abort_all_requests"}, "/update_weights_from_disk")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
      raise RequestError("model_path must be a non-empty string")
    if not Path(path).is_dir():
      raise RequestError(f"model_path {path!r} is not a directory on this server",
                         HTTPStatus.BAD_REQUEST)
    version = body.get("weight_version")
    version = str(version) if version is not None else path
    t0 = time.perf_counter()
    try:
      model = self.served.load(path)
    except (FileNotFoundError, KeyError, ValueError) as e:
      raise RequestError(f"model_path {path!r} could not be loaded: {e}") from e
    try:
      self.worker.call(lambda engine: engine.update_params(model, version))
    except ValueError as e:
      raise RequestError(f"model_path {path!r} does not fit the served model: {e}") from e
    self.served.model_path = path
    return {"success": True, "weight_version": version,
            "message": f"loaded {path} as weight_version {version} in "
                       f"{time.perf_counter() - t0:.2f}s"}

  def flush_cache(self, _body) -> dict:
    self.worker.call(lambda engine: engine.flush())
    return {"success": True, "message": "cache flushed"}

  def chat_completions(self, body: Any) -> dict:
    body = _object(body, "request body")
    _no_unknown(body, _CHAT_FIELDS, "/v1/chat/completions")
    fmt = self.served.chat_format
    if fmt is None:
      raise RequestError("this checkpoint has no tokenizer, so /v1/chat/completions is off")
    model = body.get("model")
    names = {None, "default", self.served.model_path, Path(self.served.model_path).name}
    if model not in names:
      raise RequestError(f"unknown model {model!r}; this server serves "
                         f"{Path(self.served.model_path).name!r}", HTTPStatus.NOT_FOUND)
    if body.get("stream"):
      raise RequestError("stream = true is not supported by bat_jax.serve")
    if body.get("n", 1) != 1:
      raise RequestError(f"n = {body.get('n')!r} is not supported (only 1)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
      raise RequestError("messages must be a non-empty list")
    tools = body.get("tools") or []
    if not isinstance(tools, list):
      raise RequestError("tools must be a list")
    try:
      ids = fmt.encode_prompt(openai_to_messages(messages), tools)
    except (KeyError, TypeError, ValueError) as e:
      raise RequestError(f"messages could not be rendered: {e}") from e
    self.served.engine.check_prompt(ids, "messages")
    sampling_fields = {"max_new_tokens": body.get("max_completion_tokens",
                                                  body.get("max_tokens")),
                       "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                       "top_k": body.get("top_k"), "stop_token_ids": list(fmt.stop_token_ids)}
    try:
      sampling = SamplingParams.from_dict(
          sampling_fields, default_max_new_tokens=self.served.default_max_new_tokens)
    except (ValueError, TypeError) as e:
      raise RequestError(str(e).replace("sampling_params.", "")) from e
    completion = self.worker.generate_many([GenerateRequest(ids, sampling)])[0]
    return chat_answer(completion, self.served.tokenizer, fmt,
                       model_name=Path(self.served.model_path).name)

  def _need_tokenizer(self, field: str):
    if self.served.tokenizer is None:
      raise RequestError(f"{field} needs a tokenizer, and this checkpoint has none; "
                         "send input_ids")
    return self.served.tokenizer


def _object(body: Any, what: str) -> dict:
  if not isinstance(body, dict):
    raise RequestError(f"{what} must be a JSON object")
  return body


def _no_unknown(body: Mapping, allowed, endpoint: str) -> None:
  unknown = sorted(set(body) - set(allowed))
  if unknown:
    raise RequestError(f"{endpoint} does not accept field(s) {unknown}; "
                       f"accepted: {sorted(allowed)}")


def _error(message: str) -> dict:
  return {"error": {"message": message}, "success": False, "message": message}


# -- transport ------------------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
  app: ServeApp  # set on the subclass made by make_server
  protocol_version = "HTTP/1.1"

  def log_message(self, fmt, *args):  # route access logs through logging
    log.debug("%s %s", self.address_string(), fmt % args)

  def _send(self, status: int, payload: Any) -> None:
    data = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _serve(self, method: str) -> None:
    body = None
    if method == "POST":
      length = int(self.headers.get("Content-Length") or 0)
      if length > MAX_BODY_BYTES:
        self._send(413, _error(f"request body of {length} bytes exceeds {MAX_BODY_BYTES}"))
        return
      raw = self.rfile.read(length) if length else b""
      try:
        body = json.loads(raw) if raw else {}
      except json.JSONDecodeError as e:
        self._send(400, _error(f"request body is not valid JSON: {e}"))
        return
    try:
      status, payload = self.app.handle(method, self.path, body)
    except Exception as e:  # pylint: disable=broad-except
      log.exception("%s %s failed", method, self.path)
      status, payload = 500, _error(f"internal error: {type(e).__name__}: {e}")
    self._send(status, payload)

  def do_GET(self):  # noqa: N802 (http.server naming)
    self._serve("GET")

  def do_POST(self):  # noqa: N802
    self._serve("POST")


def make_server(app: ServeApp, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
  """An HTTP server bound to (host, port); port 0 picks a free one (see server_address)."""
  handler = type("Handler", (_Handler,), {"app": app})
  server = ThreadingHTTPServer((host, port), handler)
  server.daemon_threads = True
  return server


def serve_in_thread(app: ServeApp, host: str = "127.0.0.1", port: int = 0
                    ) -> tuple[ThreadingHTTPServer, str]:
  """Starts the server on a daemon thread; returns it and its base URL."""
  server = make_server(app, host, port)
  threading.Thread(target=server.serve_forever, name="bat-jax-serve", daemon=True).start()
  h, p = server.server_address[:2]
  return server, f"http://{h}:{p}"


def load_served_model(checkpoint: str, config: JaxEngineConfig, *, dtype: Optional[str] = None,
                      weight_version: str = "0") -> ServedModel:
  """Loads an HF checkpoint dir (weights + config, tokenizer files if present)."""
  from bat_jax.model import load_pretrained
  path = Path(checkpoint)
  if not path.is_dir():
    raise FileNotFoundError(f"--checkpoint {checkpoint!r} is not a directory")
  load = lambda p: load_pretrained(p, dtype=dtype)  # noqa: E731
  model = load(str(path))
  tokenizer = chat_format = None
  if (path / "tokenizer.json").is_file():
    from bat_jax.model.tokenizer import ChatFormat, load_tokenizer
    tokenizer = load_tokenizer(path)
    chat_format = ChatFormat.for_model(model.config.model_type, tokenizer)
  else:
    log.warning("%s has no tokenizer.json: /generate needs input_ids and chat is off", path)
  engine = JaxEngine(model, config, weight_version=weight_version)
  return ServedModel(engine=engine, model_path=str(path), load=load, tokenizer=tokenizer,
                     chat_format=chat_format)


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m bat_jax.serve", description=__doc__.split(
      "\n\n")[0])
  parser.add_argument("--checkpoint", required=True, help="HF checkpoint directory")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--num-slots", type=int, default=8, help="concurrent sequences")
  parser.add_argument("--max-len", type=int, default=4096, help="tokens per sequence")
  parser.add_argument("--prefill-chunk", type=int, default=128)
  parser.add_argument("--decode-block", type=int, default=64)
  parser.add_argument("--dtype", default=None, help="compute dtype, e.g. bfloat16")
  parser.add_argument("--weight-version", default="0")
  parser.add_argument("--log-level", default="INFO")
  args = parser.parse_args(argv)
  logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  if not Path(args.checkpoint).is_dir():
    parser.error(f"--checkpoint {args.checkpoint!r} is not a directory")
  config = JaxEngineConfig(num_slots=args.num_slots, max_len=args.max_len,
                           prefill_chunk=args.prefill_chunk, decode_block=args.decode_block)
  served = load_served_model(args.checkpoint, config, dtype=args.dtype,
                             weight_version=args.weight_version)
  app = ServeApp(served)
  server = make_server(app, args.host, args.port)
  log.info("serving %s on http://%s:%d", args.checkpoint, args.host, args.port)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
    app.close()
  return 0


def _interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt  # SIGTERM shuts down like Ctrl-C: close the socket, stop the worker


if __name__ == "__main__":
  import signal
  signal.signal(signal.SIGTERM, _interrupt)
  sys.exit(main())
