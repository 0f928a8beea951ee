"""A thread that owns an engine and batches concurrent generate requests.

HTTP handler threads submit work and wait on futures; the worker runs it serially, so the
engine (not thread-safe) is only ever touched by one thread. Generate jobs that arrive within
`batch_window_s` of each other share one `engine.generate` call (up to `max_batch`). Control
jobs (weight swap, cache flush) run between batches, in arrival order.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

from bat_jax.rollout.engine import Completion, Engine, GenerateRequest, generate_isolated

log = logging.getLogger(__name__)

_STOP = object()


class EngineWorker:
  """Serialises engine access; batches generate requests that arrive together."""

  def __init__(self, engine: Engine, *, max_batch: int = 8, batch_window_s: float = 0.005):
    if max_batch < 1:
      raise ValueError(f"max_batch = {max_batch} must be >= 1")
    self.engine = engine
    self.max_batch = max_batch
    self.batch_window_s = batch_window_s
    self._queue: queue.Queue = queue.Queue()
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
    """Runs `fn(engine)` on the worker thread between batches and returns its result."""
    fut: Future = Future()
    self._queue.put(("call", fn, fut))
    return fut.result(timeout=timeout_s)

  def close(self) -> None:
    self._queue.put(_STOP)
    self._thread.join(timeout=30)

  def _run(self) -> None:
    pending: list = []
    while True:
      job = pending.pop(0) if pending else self._queue.get()
      if job is _STOP:
        return
      kind, payload, fut = job
      if kind == "call":
        _resolve(fut, lambda: payload(self.engine))
        continue
      batch = [(payload, fut)]
      # Gather requests that arrive together; a control job ends the batch (keeps order).
      while len(batch) < self.max_batch:
        try:
          nxt = self._queue.get(timeout=self.batch_window_s)
        except queue.Empty:
          break
        if nxt is not _STOP and nxt[0] == "generate":
          batch.append((nxt[1], nxt[2]))
        else:
          pending.append(nxt)
          break
      self._generate(batch)

  def _generate(self, batch: list[tuple[GenerateRequest, Future]]) -> None:
    live = [(r, f) for r, f in batch if f.set_running_or_notify_cancel()]
    if not live:
      return
    results = generate_isolated(self.engine, [r for r, _ in live])
    for (_, f), result in zip(live, results):
      if isinstance(result, Exception):
        f.set_exception(result)
      else:
        f.set_result(result)


def _resolve(fut: Future, fn: Callable[[], Any]) -> None:
  if not fut.set_running_or_notify_cancel():
    return
  try:
    fut.set_result(fn())
  except BaseException as e:  # pylint: disable=broad-except
    fut.set_exception(e)
