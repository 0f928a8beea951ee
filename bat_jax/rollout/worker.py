"""A thread that owns an engine and batches concurrent generate requests continuously.

Callers (evaluator cells, HTTP handler threads) submit work and wait on futures; the worker runs
it serially, so the engine (not thread-safe) is only ever touched by one thread.

Generate requests are batched at the iteration level: each *step* calls `engine.generate` once
for every running request with a budget of at most `step_tokens` new tokens; a request goes on
in the next step by sending its prompt plus what it generated so far under the same
`session_id`, which a prefix-caching engine (`JaxEngine`) turns into a zero-token prefill. A
request that arrives while others decode joins at the next step boundary, up to `max_batch`
running requests, instead of waiting for the whole batch to finish: with requests that come
and go at different times (evaluator cells between tool calls) the steps stay full.
`step_tokens=None` sends each request whole (for engines without a prefix cache).

Control jobs (`call`: a weight swap, a flush) wait until no request runs, and requests that
arrive after one wait for it, so every completion comes from one weight version. `release`
(dropping finished sessions' cache) runs between steps.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

from bat_jax.rollout.engine import Completion, Engine, GenerateRequest, generate_isolated

log = logging.getLogger(__name__)

_STOP = object()


@dataclasses.dataclass(eq=False)
class _Running:
  """A request being generated over one or more steps."""
  request: GenerateRequest
  future: Future
  out_ids: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  cached_tokens: Optional[int] = None
  weight_version: str = ""

  @property
  def remaining(self) -> int:
    return self.request.sampling.max_new_tokens - len(self.out_ids)

  def step_request(self, step_tokens: Optional[int]) -> tuple[GenerateRequest, int]:
    """The request for the next step and the tokens it asks for."""
    asked = self.remaining if step_tokens is None else min(step_tokens, self.remaining)
    r = self.request
    ids = tuple(r.input_ids) + tuple(self.out_ids)
    sampling = dataclasses.replace(r.sampling, max_new_tokens=asked)
    return GenerateRequest(ids, sampling, r.session_id, r.token_mask), asked

  def absorb(self, c: Completion, asked: int) -> Optional[str]:
    """Adds a step's output; returns the finish reason once the request is done."""
    if self.cached_tokens is None:
      self.cached_tokens = c.cached_tokens
    self.weight_version = c.weight_version
    self.out_ids.extend(c.output_ids)
    self.logprobs.extend(c.logprobs)
    if c.finish_reason == "stop":
      return "stop"
    # Fewer tokens than asked without a stop: the context is full.
    if self.remaining <= 0 or len(c.output_ids) < asked or c.finish_reason != "length":
      return c.finish_reason
    return None

  def completion(self, reason: str) -> Completion:
    return Completion(output_ids=tuple(self.out_ids), logprobs=tuple(self.logprobs),
                      finish_reason=reason, prompt_tokens=len(self.request.input_ids),
                      cached_tokens=self.cached_tokens or 0,
                      weight_version=self.weight_version)


class EngineWorker:
  """Owns `engine` on one thread; see the module docstring.

  Args:
    engine: the engine to drive.
    max_batch: running requests at most (the engine's slots).
    batch_window_s: when idle, how long the first request waits for others to join it.
    step_tokens: new tokens per request per step (None: whole requests).
  """

  def __init__(self, engine: Engine, *, max_batch: int = 8, batch_window_s: float = 0.005,
               step_tokens: Optional[int] = None):
    if max_batch < 1:
      raise ValueError(f"max_batch = {max_batch} must be >= 1")
    if step_tokens is not None and step_tokens < 1:
      raise ValueError(f"step_tokens = {step_tokens} must be >= 1 (or None)")
    self.engine = engine
    self.max_batch = max_batch
    self.batch_window_s = batch_window_s
    self.step_tokens = step_tokens
    self.steps = 0            # engine calls made
    self.step_sizes: list[int] = []   # requests per engine call
    self._queue: queue.Queue = queue.Queue()
    self._running: list[_Running] = []
    self._control: Optional[tuple] = None
    self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
    self._thread.start()

  def submit_generate(self, request: GenerateRequest) -> Future:
    """Queues one request; the future resolves to its Completion (or its error)."""
    fut: Future = Future()
    self._queue.put(("generate", request, fut))
    return fut

  def generate_many(self, requests: Sequence[GenerateRequest],
                    timeout_s: Optional[float] = None) -> list[Completion]:
    futures = [self.submit_generate(r) for r in requests]
    return [f.result(timeout=timeout_s) for f in futures]

  def call(self, fn: Callable[[Engine], Any], timeout_s: Optional[float] = None) -> Any:
    """Runs `fn(engine)` on the worker thread once no request runs; returns its result."""
    return self._submit("call", fn, timeout_s)

  def release(self, session_ids: Sequence[str], timeout_s: Optional[float] = None) -> None:
    """Drops the engine's cache of finished sessions, between steps."""
    ids = list(session_ids)
    self._submit("between_steps", lambda engine: engine.release(ids), timeout_s)

  def close(self) -> None:
    self._queue.put(_STOP)
    self._thread.join(timeout=30)

  def _submit(self, kind: str, fn: Callable[[Engine], Any], timeout_s: Optional[float]) -> Any:
    fut: Future = Future()
    self._queue.put((kind, fn, fut))
    return fut.result(timeout=timeout_s)

  # -- the worker thread -----------------------------------------------------------------------

  def _run(self) -> None:
    while True:
      if not self._take_jobs():
        break
      if self._running:
        self._step()
      elif self._control is not None:
        _, fn, fut = self._control
        self._control = None
        _resolve(fut, lambda: fn(self.engine))
    closed = RuntimeError("the engine worker was closed")
    waiting = [r.future for r in self._running]
    if self._control is not None:
      waiting.append(self._control[2])
    for fut in waiting:
      fut.set_exception(closed)

  def _take_jobs(self) -> bool:
    """Moves queued jobs in: generate requests up to `max_batch` running (none after a control
    job), between-steps jobs at once. Blocks only while idle. False once closed."""
    idle = not self._running and self._control is None
    first = True
    while self._control is None and len(self._running) < self.max_batch:
      try:
        if idle and first:
          job = self._queue.get()
        elif idle:  # a burst: let requests sent together start together
          job = self._queue.get(timeout=self.batch_window_s)
        else:
          job = self._queue.get_nowait()
      except queue.Empty:
        break
      first = False
      if job is _STOP:
        return False
      kind, payload, fut = job
      if kind == "generate":
        if fut.set_running_or_notify_cancel():
          self._running.append(_Running(payload, fut))
      elif kind == "between_steps":
        _resolve(fut, lambda: payload(self.engine))
      else:
        self._control = job
    return True

  def _step(self) -> None:
    pairs = [r.step_request(self.step_tokens) for r in self._running]
    self.steps += 1
    self.step_sizes.append(len(pairs))
    results = generate_isolated(self.engine, [req for req, _ in pairs])
    for r, (_, asked), result in zip(list(self._running), pairs, results):
      if isinstance(result, Exception):
        self._running.remove(r)
        r.future.set_exception(result)
        continue
      reason = r.absorb(result, asked)
      if reason is not None:
        self._running.remove(r)
        r.future.set_result(r.completion(reason))


def _resolve(fut: Future, fn: Callable[[], Any]) -> None:
  if not fut.set_running_or_notify_cancel():
    return
  try:
    fut.set_result(fn())
  except BaseException as e:  # pylint: disable=broad-except
    fut.set_exception(e)
