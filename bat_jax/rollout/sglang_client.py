"""Async HTTP client for an SGLang 0.5.23 server (or our `bat_jax.rollout.server`, same subset).

Protocol (DESIGN.md section 4): `POST /generate` with `input_ids`, `sampling_params`,
`return_logprob: true` and `rid`; token ids AND logprobs are read from
`meta_info.output_token_logprobs` (`[[logprob, token_id, text], ...]`), never re-tokenised
from text. Those logprobs are log softmax(logits / T) over the full vocabulary (greedy: T = 1),
the same contract as every engine here (`bat_jax.rollout.sampling`). A null logprob (SGLang's
schema allows it) becomes NaN: "unknown", never a made-up number.

Weight sync = HF safetensors on local disk + `POST /update_weights_from_disk`, then
`/flush_cache` (400 while requests are in flight: retry), then a check of the version the
server reports at `/model_info` (`/get_model_info` is deprecated in 0.5.23).

Errors, as SGLang 0.5.23 answers them:

* an over-context prompt is HTTP 400 whose message says so (`TokenizerManager.
  _validate_one_request`, `validate_input_length`); it raises `ContextLengthExceededError`, a
  `PromptTooLongError`, exactly what the JAX engine raises, so the agent loop ends that
  trajectory as `context_full`;
* an aborted request is HTTP 200 with `finish_reason.type == "abort"` (kept as such: the agent
  loop marks the trajectory `aborted`, never trains on it);
* connection errors and 5xx are retried with bounded exponential backoff
  (`rollout.sglang.max_retries`); after that a `ServerUnavailableError` names the URL and the
  last error. Any other 4xx is the caller's fault and is raised at once with the server's message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import httpx

from bat_jax.rollout.engine import (Completion, GenerateRequest, PromptTooLongError,
                                    SamplingParams)

log = logging.getLogger(__name__)


class SGLangError(RuntimeError):
  """Base class of client errors."""


class ServerUnavailableError(SGLangError):
  """The server could not be reached (or kept failing) after the allowed retries."""


class RequestRejectedError(SGLangError):
  """The server answered 4xx: the request itself is wrong."""

  def __init__(self, path: str, status: int, message: str):
    super().__init__(f"{path} rejected with HTTP {status}: {message}")
    self.path = path
    self.status = status
    self.message = message


class ContextLengthExceededError(PromptTooLongError):
  """The server refused the prompt as longer than its context (SGLang's HTTP 400)."""


# SGLang 0.5.23's over-context messages (tokenizer_manager.py, managers/utils.py, scheduler.py);
# `bat_jax.rollout.server` answers with the first one, as the JAX engine words it.
_CONTEXT_400 = re.compile(
    r"is longer than the model's context length|exceeds the model's maximum context length|"
    r"exceeds the maximum allowed length|Request prompt exceeds the KV memory budget")


class ProtocolError(SGLangError):
  """The server answered 2xx with a body that does not follow the protocol."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
  """Bounded exponential backoff: delay_i = min(max_delay_s, base_delay_s * 2**i)."""
  max_retries: int = 5
  base_delay_s: float = 0.25
  max_delay_s: float = 4.0

  def delay(self, attempt: int) -> float:
    return min(self.max_delay_s, self.base_delay_s * (2 ** attempt))


# Connection-level failures only: a read timeout on a long /generate is not retried (it would
# send the same slow request again).
_RETRYABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError,
                     httpx.WriteError, httpx.RemoteProtocolError)


def _retryable_status(status: int) -> bool:
  return 500 <= status < 600


class SGLangClient:
  """Async client. Use as `async with SGLangClient(url) as client: ...`."""

  def __init__(self, base_url: str, *, timeout_s: float = 600.0,
               retry: RetryPolicy = RetryPolicy(),
               transport: Optional[httpx.AsyncBaseTransport] = None):
    self.base_url = base_url.rstrip("/")
    self.retry = retry
    self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s,
                                   transport=transport)

  async def __aenter__(self) -> "SGLangClient":
    return self

  async def __aexit__(self, *exc) -> None:
    await self.aclose()

  async def aclose(self) -> None:
    await self._http.aclose()

  async def _request(self, method: str, path: str, payload: Optional[dict] = None) -> Any:
    """Sends one request, retrying connection errors and 5xx; returns the decoded body."""
    last_error = "no attempt made"
    for attempt in range(self.retry.max_retries + 1):
      try:
        resp = await self._http.request(method, path, json=payload)
      except _RETRYABLE_ERRORS as e:
        last_error = f"{type(e).__name__}: {e}"
      else:
        if resp.status_code < 400:
          return _decode(resp)
        message = _error_message(resp)
        if not _retryable_status(resp.status_code):
          raise RequestRejectedError(path, resp.status_code, message)
        last_error = f"HTTP {resp.status_code}: {message}"
      if attempt < self.retry.max_retries:
        delay = self.retry.delay(attempt)
        log.warning("%s %s%s failed (%s); retry %d/%d in %.2fs", method, self.base_url, path,
                    last_error, attempt + 1, self.retry.max_retries, delay)
        await asyncio.sleep(delay)
    raise ServerUnavailableError(
        f"{method} {self.base_url}{path} failed after {self.retry.max_retries + 1} attempts; "
        f"last error: {last_error}. Is the server running (see its log)?")

  # -- endpoints ------------------------------------------------------------------------------

  async def health(self) -> bool:
    """True when `/health` answers 200 (one attempt, no retries)."""
    try:
      resp = await self._http.get("/health")
    except (httpx.TransportError, httpx.TimeoutException):
      return False
    return resp.status_code == 200

  async def generate(self, input_ids: Sequence[int], sampling: SamplingParams,
                     *, rid: Optional[str] = None) -> Completion:
    """`POST /generate`; ids and logprobs come from `meta_info.output_token_logprobs`.

    Raises ContextLengthExceededError (a PromptTooLongError) on SGLang's over-context 400.
    """
    payload = {"input_ids": [int(t) for t in input_ids], "sampling_params": sampling.to_dict(),
               "return_logprob": True, "rid": rid or uuid.uuid4().hex}
    try:
      body = await self._request("POST", "/generate", payload)
    except RequestRejectedError as e:
      if e.status == 400 and _CONTEXT_400.search(e.message):
        raise ContextLengthExceededError(f"{self.base_url}/generate: {e.message}") from e
      raise
    return parse_generate_response(body, prompt_tokens=len(payload["input_ids"]))

  async def model_info(self) -> dict:
    """`GET /model_info` (model_path, weight_version, ...).

    Falls back to the deprecated `/get_model_info` only on a 404 (servers older than SGLang
    0.5, where it was the only name); SGLang 0.5.23 logs a deprecation warning for it.
    """
    try:
      body = await self._request("GET", "/model_info")
    except RequestRejectedError as e:
      if e.status != 404:
        raise
      body = await self._request("GET", "/get_model_info")
    if not isinstance(body, dict):
      raise ProtocolError(f"/model_info answered {str(body)[:300]!r}, not a JSON object")
    return body

  async def weight_version(self) -> Optional[str]:
    """The weight version the server reports at `/model_info` (None if it reports none)."""
    version = (await self.model_info()).get("weight_version")
    return None if version is None else str(version)

  async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
    """Frees the server's GPU memory (`tags` of "weights", "kv_cache", "cuda_graph"; None:
    all). SGLang needs `--enable-memory-saver` and an idle server."""
    await self._request("POST", "/release_memory_occupation",
                        {"tags": None if tags is None else list(tags)})

  async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
    """Takes back what `release_memory_occupation` freed (None: all)."""
    await self._request("POST", "/resume_memory_occupation",
                        {"tags": None if tags is None else list(tags)})

  async def flush_cache(self, *, attempts: int = 20, delay_s: float = 0.25) -> None:
    """`POST /flush_cache`, retrying while the server answers 400 (requests in flight)."""
    for i in range(attempts):
      try:
        await self._request("POST", "/flush_cache", {})
        return
      except RequestRejectedError as e:
        if e.status != 400 or i == attempts - 1:
          raise
        await asyncio.sleep(delay_s)

  async def update_weights_from_disk(self, model_path: str | Path, weight_version: str,
                                     *, flush_cache: bool = True) -> dict:
    """Loads HF safetensors from `model_path` on the server; raises if it says no."""
    body = await self._request("POST", "/update_weights_from_disk", {
        "model_path": str(model_path), "flush_cache": flush_cache,
        "weight_version": str(weight_version)})
    if not isinstance(body, dict) or not body.get("success", False):
      raise SGLangError(f"update_weights_from_disk({model_path}) failed: {body!r}")
    return body


def parse_generate_response(body: Any, *, prompt_tokens: int) -> Completion:
  """Turns one `/generate` JSON answer into a Completion (ids + logprobs from meta_info)."""
  if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
    raise ProtocolError(f"/generate answer has no meta_info object: {str(body)[:300]}")
  meta = body["meta_info"]
  entries = meta.get("output_token_logprobs")
  if not isinstance(entries, list):
    raise ProtocolError("meta_info.output_token_logprobs missing: was return_logprob sent?")
  ids, logps = [], []
  for i, e in enumerate(entries):
    if not isinstance(e, (list, tuple)) or len(e) < 2:
      raise ProtocolError(f"meta_info.output_token_logprobs[{i}] = {e!r} is not "
                          "[logprob, token_id, ...]")
    ids.append(int(e[1]))
    logps.append(math.nan if e[0] is None else float(e[0]))
  output_ids = body.get("output_ids")
  if output_ids is not None and list(output_ids) != ids:
    raise ProtocolError("output_ids disagree with meta_info.output_token_logprobs ids")
  finish = meta.get("finish_reason")
  reason = finish.get("type") if isinstance(finish, dict) else finish
  if reason not in ("stop", "length", "abort"):
    raise ProtocolError(f"meta_info.finish_reason = {finish!r} is not stop|length|abort")
  return Completion(output_ids=tuple(ids), logprobs=tuple(logps), finish_reason=reason,
                    prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
                    cached_tokens=int(meta.get("cached_tokens", 0) or 0),
                    weight_version=str(meta.get("weight_version", "") or ""))


@dataclasses.dataclass(frozen=True)
class WeightSyncTimes:
  export_s: float
  update_s: float
  flush_s: float


async def sync_weights(client: SGLangClient, export: Callable[[Path], None], export_dir: Path,
                       weight_version: str) -> WeightSyncTimes:
  """Exports weights to `export_dir`, loads them on the server and checks the version.

  Args:
    client: the server's client.
    export: writes HF safetensors + config.json into the directory it is given, e.g.
      `lambda d: bat_jax.model.save_pretrained(model, d, tokenizer_dir=tok)`.
    export_dir: fast local disk, visible to the server under the same path.
    weight_version: the label the server must report afterwards.
  """
  t0 = time.perf_counter()
  export_dir = Path(export_dir)
  export_dir.mkdir(parents=True, exist_ok=True)
  export(export_dir)
  t1 = time.perf_counter()
  await client.update_weights_from_disk(export_dir, weight_version, flush_cache=True)
  t2 = time.perf_counter()
  await client.flush_cache()
  reported = await client.weight_version()
  if reported is not None and reported != str(weight_version):
    raise SGLangError(f"after update_weights_from_disk the server reports weight_version "
                      f"{reported!r}, expected {weight_version!r}")
  return WeightSyncTimes(export_s=t1 - t0, update_s=t2 - t1,
                         flush_s=time.perf_counter() - t2)


class SGLangEngine:
  """The `Engine` interface over an SGLang server (sync; runs its own event loop).

  Requests of one `generate` call are sent concurrently; the server batches them. Sessions
  need no bookkeeping here: SGLang's radix cache reuses the shared prefix by itself.
  """

  def __init__(self, base_url: str, *, max_concurrency: int = 256, **client_kwargs):
    """client_kwargs go to SGLangClient (timeout_s, retry, transport)."""
    self._loop = asyncio.new_event_loop()
    self._client_kwargs = client_kwargs
    self._base_url = base_url
    self._client: Optional[SGLangClient] = None
    self._max_concurrency = max_concurrency
    self._weight_version = ""

  def _run(self, coro):
    return self._loop.run_until_complete(coro)

  @property
  def client(self) -> SGLangClient:
    if self._client is None:  # created lazily so it binds to our loop
      async def make():
        return SGLangClient(self._base_url, **self._client_kwargs)
      self._client = self._run(make())
    return self._client

  def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
    client = self.client
    limit = asyncio.Semaphore(self._max_concurrency)

    async def one(req: GenerateRequest) -> Completion:
      async with limit:
        return await client.generate(req.input_ids, req.sampling)

    async def run_all():
      return await asyncio.gather(*(one(r) for r in requests))
    completions = list(self._run(run_all()))
    stale = sorted({c.weight_version for c in completions
                    if self._weight_version and c.weight_version
                    and c.weight_version != self._weight_version})
    if stale:  # a server that missed the last sync (or another trainer's server)
      raise SGLangError(f"{self._base_url} answered with weight_version {stale}, expected "
                        f"{self._weight_version!r} (the last one synced)")
    return completions

  def release(self, session_ids: Sequence[str]) -> None:
    del session_ids  # radix cache entries are evicted by the server

  @property
  def weight_version(self) -> str:
    return self._weight_version

  def sync_weights(self, export: Callable[[Path], None], export_dir: Path,
                   weight_version: str) -> WeightSyncTimes:
    times = self._run(sync_weights(self.client, export, export_dir, weight_version))
    self._weight_version = str(weight_version)
    return times

  def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
    self._run(self.client.release_memory_occupation(tags))

  def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
    self._run(self.client.resume_memory_occupation(tags))

  def close(self) -> None:
    if self._client is not None:
      self._run(self._client.aclose())
    self._loop.close()


def _decode(resp: httpx.Response) -> Any:
  try:
    return resp.json()
  except ValueError:
    return resp.text


def _error_message(resp: httpx.Response) -> str:
  body = _decode(resp)
  if isinstance(body, dict):
    err = body.get("error", body.get("message", body))
    if isinstance(err, dict):
      err = err.get("message", err)
    return str(err)
  return str(body)[:500]
