"""Request routing and the SGLang-protocol endpoints of `bat_jax.rollout.server` (transport-free)."""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time
import uuid
from http import HTTPStatus
from pathlib import Path
from typing import Any, Callable, Optional

import jax

from bat_jax.model.chat_format import ChatFormat
from bat_jax.rollout.server import params as P
from bat_jax.rollout.server.grammar import sglang_grammar
from bat_jax.rollout.server.params import RequestError
from bat_jax.rollout.server.scheduler import Job, Scheduler
from bat_jax.rollout.server.text import find_stop, top_logprobs

log = logging.getLogger("bat_jax.serve")

_GENERATE_FIELDS = frozenset({"input_ids", "text", "sampling_params", "return_logprob", "rid",
                              "stream", "logprob_start_len", "return_text_in_logprobs",
                              "top_logprobs_num"})
MEMORY_TAGS = ("weights", "kv_cache")


class ClientGone(Exception):
  """The client closed its connection while its request was being generated."""


@dataclasses.dataclass
class ServedModel:
  """What the server answers with; `load` turns a checkpoint dir into an nnx model.

  `graphdef` (nnx) is needed for top logprobs and for releasing the KV cache; `served_name` is
  the model name clients use (default: the checkpoint folder's name).
  """
  engine: Any
  model_path: str
  load: Callable[[str], Any]
  tokenizer: Any = None        # transformers tokenizer, or None (then no text / chat)
  chat_format: Optional[ChatFormat] = None
  graphdef: Any = None
  served_name: Optional[str] = None

  @property
  def name(self) -> str:
    return self.served_name or Path(self.model_path).name


class ServeApp:
  """Validates requests, runs them through the scheduler, and answers JSON (or a stream)."""

  def __init__(self, served: ServedModel, *, step_tokens: Optional[int] = None,
               api_key: Optional[str] = None):
    from bat_jax.rollout.server import completions, openai_api  # OpenAI endpoints, beside this
    self.served = served
    self.api_key = api_key or None
    self.warned: set = set()   # (endpoint, unknown field) pairs already logged once
    cfg = served.engine.config
    self.max_stop_ids = cfg.max_stop_ids
    self.scheduler = Scheduler(lambda: self.served.engine, num_slots=cfg.num_slots,
                               step_tokens=step_tokens or cfg.decode_block,
                               stop_matcher=self._match_stop, rescore=self._rescore)
    self.released: set[str] = set()
    self._parked: dict[str, Any] = {}
    self.openai = openai_api.OpenAIChat(self)
    self.completions = completions.Completions(self)
    ok = lambda *_: {"status": "ok"}  # noqa: E731
    info = lambda *_: self.model_info()  # noqa: E731
    # Every route is (body, client_gone) -> answer.
    self.routes = {
        ("GET", "/health"): ok,
        ("GET", "/health_generate"): ok,
        ("GET", "/model_info"): info,
        ("GET", "/get_model_info"): info,  # deprecated in SGLang 0.5.23, kept as an alias
        ("GET", "/get_weight_version"):
            lambda *_: {"weight_version": self.served.engine.weight_version},
        ("GET", "/v1/models"): lambda *_: self.openai.models(),
        ("POST", "/generate"): self.generate,
        ("POST", "/update_weights_from_disk"): lambda b, _: self.update_weights_from_disk(b),
        ("POST", "/flush_cache"): lambda *_: self.flush_cache(),
        ("POST", "/release_memory_occupation"): lambda b, _: self.release_memory(b),
        ("POST", "/resume_memory_occupation"): lambda b, _: self.resume_memory(b),
        ("POST", "/v1/chat/completions"): self.openai.chat_completions,
        ("POST", "/v1/completions"): self.completions.create,
    }

  def close(self) -> None:
    self.scheduler.close()

  def handle(self, method: str, path: str, body: Any,
             client_gone: Callable[[], bool] = lambda: False,
             authorization: Optional[str] = None) -> tuple[int, Any]:
    """(status, JSON-able answer or an iterator of stream events) for one request.

    `authorization`: the request's Authorization header; with an api_key, every endpoint but
    /health and /health_generate needs `Bearer <api_key>` (admin endpoints included)."""
    path = path.split("?", 1)[0]
    if self.api_key is not None and path not in OPEN_PATHS and not _key_ok(
        authorization, self.api_key):
      return 401, error("Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                        "(--api-key)", "invalid_api_key")
    route = self.routes.get((method, path))
    if route is None and method == "GET" and path.startswith("/v1/models/"):
      route = lambda *_: self.openai.model(path[len("/v1/models/"):])  # noqa: E731
    if route is None:
      if path in {p for _, p in self.routes}:
        return 405, error(f"{method} is not allowed on {path}")
      known = sorted(p for m, p in self.routes if m == method)
      return 404, error(f"unknown endpoint {method} {path}; {method} serves {known}")
    try:
      return 200, route(body, client_gone)
    except RequestError as e:
      return e.status, error(str(e))
    except ClientGone:
      return 499, error("client closed the connection")
    except UnicodeError as e:  # a lone surrogate (valid JSON, not encodable text)
      return 400, error(f"request text is not valid Unicode: {e}"[:2000])
    except (ValueError, RecursionError) as e:  # engine-side checks: prompt length, token ids
      return 400, error(str(e)[:2000])

  # -- generation shared by both protocols ------------------------------------------------------

  def check_available(self) -> None:
    if self.released:
      raise RequestError(f"memory is released ({sorted(self.released)}); POST "
                         "/resume_memory_occupation first", HTTPStatus.SERVICE_UNAVAILABLE)

  def run(self, jobs: list[Job], client_gone: Callable[[], bool]) -> list[Job]:
    """Submits jobs and waits for them; a vanished client cancels them."""
    self.check_available()
    self.scheduler.submit(jobs)
    try:
      for job in jobs:
        while not job.done.wait(0.2):
          if client_gone():
            raise ClientGone()
    except BaseException:
      for job in jobs:
        job.cancel()
      raise
    for job in jobs:
      if job.error is not None:
        if isinstance(job.error, RequestError):
          raise job.error
        if isinstance(job.error, ValueError):
          raise RequestError(str(job.error)[:2000])
        raise job.error
    return jobs

  def eos_token_ids(self) -> tuple[int, ...]:
    tok = self.served.tokenizer
    eos = None if tok is None else tok.eos_token_id
    return () if eos is None else (int(eos),)

  def _match_stop(self, job: Job):
    return find_stop(self.need_tokenizer("stop"), job.out_ids, job.sampling.stop, False)

  def _rescore(self, job: Job) -> list:
    if self.served.graphdef is None:
      raise RuntimeError("top logprobs need ServedModel.graphdef")
    return top_logprobs(self.served.graphdef, self.served.engine.params, job.prompt,
                        job.out_ids, job.sampling.top_logprobs,
                        job.sampling.logprob_temperature)

  def jobs(self, prompts: list, sampling) -> list[Job]:
    """n jobs per prompt; each gets its own grammar state when the sampling constrains."""
    return [Job(tuple(ids), sampling, index=j, constraint=self.constraint(sampling))
            for ids in prompts for j in range(sampling.n)]

  def constraint(self, sampling) -> Any:
    if sampling.grammar is None:
      return None
    from bat_jax.rollout.server.grammar import TokenConstraint
    return TokenConstraint(sampling.grammar, self.need_tokenizer("constrained decoding"),
                           self.served.engine.vocab_size, sampling.engine_stop_ids)

  def need_tokenizer(self, field: str):
    if self.served.tokenizer is None:
      raise RequestError(f"{field} needs a tokenizer, and this checkpoint has none "
                         "(or --skip-tokenizer-init); send input_ids")
    return self.served.tokenizer

  # -- SGLang endpoints -------------------------------------------------------------------------

  def model_info(self) -> dict:
    engine = self.served.engine
    return {"model_path": self.served.model_path, "tokenizer_path": self.served.model_path,
            "served_model_name": self.served.name, "is_generation": True,
            "weight_version": engine.weight_version, "max_total_tokens": engine.config.max_len,
            "max_running_requests": engine.config.num_slots,
            "has_chat": self.served.chat_format is not None,
            "preferred_sampling_params": None, "memory_released": sorted(self.released)}

  def generate(self, body: Any, client_gone: Callable[[], bool]) -> Any:
    body = P.obj(body, "request body")
    P.no_unknown(body, _GENERATE_FIELDS, "/generate")
    if body.get("stream"):
      raise RequestError("stream = true is not supported on /generate by bat_jax.serve; "
                         "stream through /v1/chat/completions")
    if body.get("logprob_start_len") not in (None, -1):
      raise RequestError("logprob_start_len: only -1 (output tokens only) is supported")
    prompts, batched = self._prompts(body)
    with_logprob = P.boolean(body.get("return_logprob", False) or False, "return_logprob")
    with_text = P.boolean(body.get("return_text_in_logprobs", False) or False,
                          "return_text_in_logprobs")
    top_n = P.integer(body.get("top_logprobs_num") or 0, "top_logprobs_num", lo=0,
                      hi=P.MAX_TOP_LOGPROBS)
    vocab = self.served.engine.vocab_size
    sampling = P.sglang_sampling(body.get("sampling_params"), vocab_size=vocab,
                                 eos_token_ids=self.eos_token_ids(),
                                 max_stop_ids=self.max_stop_ids,
                                 top_logprobs=top_n if with_logprob else 0)
    grammar = sglang_grammar(body.get("sampling_params") or {})
    if grammar is not None:
      sampling = dataclasses.replace(sampling, grammar=grammar)
    if sampling.stop:
      self.need_tokenizer("sampling_params.stop")
    rids = self._rids(body.get("rid"), len(prompts), batched)
    if len(prompts) * sampling.n > P.MAX_BATCH:
      raise RequestError(f"{len(prompts)} prompts x n = {sampling.n} exceeds "
                         f"{P.MAX_BATCH} samples per request")
    for i, ids in enumerate(prompts):
      self.served.engine.check_prompt(ids, "input_ids" if not batched else f"input_ids[{i}]")
    jobs = self.jobs(prompts, sampling)
    t0 = time.perf_counter()
    self.run(jobs, client_gone)
    answers = [self._generate_answer(job, rid if sampling.n == 1 else f"{rid}_{job.index}",
                                     with_logprob, with_text, time.perf_counter() - t0)
               for job, rid in zip(jobs, [r for r in rids for _ in range(sampling.n)])]
    return answers if batched or sampling.n > 1 else answers[0]

  def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
    """input_ids (or text, tokenised) as a list of prompts, and whether it was a batch."""
    if ("input_ids" in body) == ("text" in body):
      raise RequestError("/generate needs exactly one of input_ids or text")
    engine = self.served.engine
    if "text" in body:
      tok = self.need_tokenizer("text")
      texts = body["text"]
      batched = isinstance(texts, list)
      texts = texts if batched else [texts]
      if not texts or len(texts) > P.MAX_BATCH or not all(isinstance(t, str) for t in texts):
        raise RequestError(f"text must be a string or a list of 1..{P.MAX_BATCH} strings")
      limit = engine.config.max_len * 64  # more characters cannot fit max_len tokens
      for i, t in enumerate(texts):
        if not _encodable(t):
          raise RequestError(f"text[{i}] holds a lone surrogate (e.g. '\\ud800'), which is not "
                             "valid Unicode text")
        if len(t) > limit:
          raise RequestError(f"text[{i}] has {len(t)} characters; the context holds "
                             f"{engine.config.max_len} tokens")
      return [tok.encode(t, add_special_tokens=False) for t in texts], batched
    ids = body["input_ids"]
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    if len(prompts) > P.MAX_BATCH:
      raise RequestError(f"input_ids holds {len(prompts)} prompts; at most {P.MAX_BATCH}")
    for i, p in enumerate(prompts):
      name = f"input_ids[{i}]" if batched else "input_ids"
      if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in p):
        raise RequestError(f"{name} must be a list of integer token ids")
      if len(p) >= engine.config.max_len:
        engine.check_prompt(p, name)
    return prompts, batched

  def _rids(self, rids: Any, n: int, batched: bool) -> list[str]:
    if rids is None:
      return [uuid.uuid4().hex for _ in range(n)]
    if not batched:
      if not isinstance(rids, str):
        raise RequestError(f"rid must be a string for a single prompt, got {P.brief(rids)}")
      return [rids]
    if not isinstance(rids, list) or len(rids) != n or not all(isinstance(r, str) for r in rids):
      raise RequestError(f"rid must be one string per prompt ({n}), got {P.brief(rids)}")
    return rids

  def _generate_answer(self, job: Job, rid: str, with_logprob: bool, with_text: bool,
                       latency: float) -> dict:
    tok, s, finish = self.served.tokenizer, job.sampling, dict(job.finish)
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(job.prompt),
            "completion_tokens": len(job.out_ids), "cached_tokens": job.cached_tokens or 0,
            "weight_version": job.weight_version, "e2e_latency": latency}
    word = (lambda t: tok.decode([t]) if with_text and tok is not None else None)
    if with_logprob:
      meta["output_token_logprobs"] = [[lp, t, word(t)]
                                       for lp, t in zip(job.logprobs, job.out_ids)]
      if job.top_logprobs is not None:
        meta["output_top_logprobs"] = [[[lp, t, word(t)] for t, lp in row]
                                       for row in job.top_logprobs]
    text = ""
    if tok is not None:
      ids = list(job.out_ids)
      if isinstance(finish.get("matched"), int) and not s.no_stop_trim and ids:
        ids = ids[:-1]
      text = tok.decode(ids, skip_special_tokens=s.skip_special_tokens)
      if isinstance(finish.get("matched"), str) and not s.no_stop_trim:
        text = text[:text.find(finish["matched"])] if finish["matched"] in text else text
    return {"text": text, "output_ids": list(job.out_ids), "meta_info": meta}

  def update_weights_from_disk(self, body: Any) -> dict:
    body = P.obj(body, "request body")
    P.no_unknown(body, {"model_path", "flush_cache", "weight_version", "load_format",
                        "abort_all_requests"}, "/update_weights_from_disk")
    self.check_available()
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
      raise RequestError("model_path must be a non-empty string")
    if not Path(path).is_dir():
      raise RequestError(f"model_path {path!r} is not a directory on this server")
    version = body.get("weight_version")
    version = str(version) if version is not None else path
    t0 = time.perf_counter()
    try:
      model = self.served.load(path)
    except (FileNotFoundError, KeyError, ValueError) as e:
      raise RequestError(f"model_path {path!r} could not be loaded: {e}") from e
    try:
      self.scheduler.call(lambda engine: engine.update_params(model, version))
    except ValueError as e:
      raise RequestError(f"model_path {path!r} does not fit the served model: {e}") from e
    self.served.model_path = path
    return {"success": True, "weight_version": version,
            "message": f"loaded {path} as weight_version {version} in "
                       f"{time.perf_counter() - t0:.2f}s"}

  def flush_cache(self) -> dict:
    self.scheduler.call(lambda engine: engine.flush())
    return {"success": True, "message": "cache flushed"}

  def _tags(self, body: Any, endpoint: str) -> list[str]:
    body = P.obj({} if body is None else body, "request body")
    P.no_unknown(body, {"tags"}, endpoint)
    tags = body.get("tags")
    if tags is None:
      return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags):
      raise RequestError(f"tags must be a list of {list(MEMORY_TAGS)}, got {P.brief(tags)}")
    return list(dict.fromkeys(tags))

  def release_memory(self, body: Any) -> dict:
    """SGLang's /release_memory_occupation: weights go to host memory, the KV cache is freed."""
    tags = [t for t in self._tags(body, "/release_memory_occupation") if t not in self.released]
    if "kv_cache" in tags and self.served.graphdef is None:
      raise RequestError("releasing kv_cache needs the model graph (ServedModel.graphdef)")
    self.scheduler.call(lambda engine: self._release(tags))
    return {"success": True, "message": f"released {tags}",
            "released": sorted(self.released)}

  def _release(self, tags: list[str]) -> None:
    """Runs on the scheduler thread. _parked: the real engine (None once its cache is freed),
    the device params kept without an engine, the host copy of released weights."""
    park = self._parked
    if not self.released:
      park.update(engine=self.served.engine, params=None, host=None)
    engine = park["engine"]
    if "weights" in tags:
      params = engine.params if engine is not None else park["params"]
      park["shardings"] = jax.tree.map(lambda x: x.sharding, params)
      park["host"] = jax.device_get(params)
      for leaf in jax.tree.leaves(params):
        leaf.delete()
      park["params"] = None
    if "kv_cache" in tags:  # dropping the engine frees its cache
      if "weights" not in self.released | set(tags):
        park["params"] = engine.params
      park["config"], park["version"] = engine.config, engine.weight_version
      park["engine"] = None
    if tags and not self.released:
      self.served.engine = _Released(self.served.engine.config, self.served.engine.vocab_size,
                                     self.served.engine.weight_version)
    self.released |= set(tags)

  def resume_memory(self, body: Any) -> dict:
    tags = [t for t in self._tags(body, "/resume_memory_occupation") if t in self.released]
    if "kv_cache" in tags and "weights" in self.released and "weights" not in tags:
      raise RequestError("weights are released too: resume them first or together")
    self.scheduler.call(lambda engine: self._resume(tags))
    return {"success": True, "message": f"resumed {tags}", "released": sorted(self.released)}

  def _resume(self, tags: list[str]) -> None:
    park = self._parked
    if "weights" in tags:
      params = jax.device_put(park.pop("host"), park.pop("shardings"))
      if park["engine"] is not None:
        park["engine"].update_params(params, park["engine"].weight_version)
      else:
        park["params"] = params
    if "kv_cache" in tags:
      from flax import nnx
      from bat_jax.rollout.jax_engine import JaxEngine
      model = nnx.merge(self.served.graphdef, park.pop("params"))
      park["engine"] = JaxEngine(model, park["config"], weight_version=park["version"])
    self.released -= set(tags)
    if not self.released:
      self.served.engine = park.pop("engine")
      park.clear()


@dataclasses.dataclass
class _Released:
  """Stands in for the engine while its KV cache is released (metadata only)."""
  config: Any
  vocab_size: int
  weight_version: str

  def check_prompt(self, ids, field="input_ids") -> None:
    self.generate([])

  def generate(self, requests) -> None:
    raise RequestError("memory is released; POST /resume_memory_occupation first",
                       HTTPStatus.SERVICE_UNAVAILABLE)


def error(message: str, code: Optional[str] = None) -> dict:
  return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                    "code": code}, "success": False, "message": message}


OPEN_PATHS = frozenset({"/health", "/health_generate"})   # answered without the API key


def _key_ok(authorization: Optional[str], key: str) -> bool:
  scheme, _, token = (authorization or "").partition(" ")
  return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _encodable(text: str) -> bool:
  try:
    text.encode("utf-8")
    return True
  except UnicodeEncodeError:
    return False
