"""EngineWorker: batches concurrent requests, isolates a bad one, keeps control ops ordered."""

from __future__ import annotations

import threading

import pytest

from bat_jax.rollout.engine import Completion, GenerateRequest
from bat_jax.rollout.worker import EngineWorker


class EchoEngine:
  """Answers each prompt with its reversed ids; a prompt holding -1 poisons its batch."""

  def __init__(self):
    self.batches: list[int] = []
    self.log: list[str] = []
    self.gate = threading.Event()

  def generate(self, requests):
    self.gate.wait(5)
    if any(-1 in r.input_ids for r in requests):
      raise ValueError("token -1 is not a token")
    self.batches.append(len(requests))
    self.log.append(f"generate x{len(requests)}")
    return [Completion(tuple(reversed(r.input_ids)), (0.0,) * len(r.input_ids), "length",
                       len(r.input_ids)) for r in requests]

  def release(self, session_ids):
    pass

  weight_version = "0"


def test_concurrent_requests_are_batched_and_answered_in_place():
  engine = EchoEngine()
  worker = EngineWorker(engine, max_batch=4, batch_window_s=0.05)
  futures = [worker.submit_generate(GenerateRequest([i, i + 1, i + 2])) for i in range(10)]
  engine.gate.set()
  results = [f.result(timeout=10) for f in futures]
  assert [r.output_ids for r in results] == [(i + 2, i + 1, i) for i in range(10)]
  assert sum(engine.batches) == 10 and max(engine.batches) > 1
  assert max(engine.batches) <= 4
  worker.close()


def test_a_bad_request_fails_alone_and_control_calls_keep_their_place():
  engine = EchoEngine()
  worker = EngineWorker(engine, max_batch=8, batch_window_s=0.05)
  good = worker.submit_generate(GenerateRequest([1, 2]))
  bad = worker.submit_generate(GenerateRequest([3, -1]))
  also_good = worker.submit_generate(GenerateRequest([4, 5]))
  engine.gate.set()
  assert good.result(timeout=10).output_ids == (2, 1)
  assert also_good.result(timeout=10).output_ids == (5, 4)
  with pytest.raises(ValueError, match="token -1"):
    bad.result(timeout=10)
  worker.call(lambda e: e.log.append("flush"))
  worker.submit_generate(GenerateRequest([7])).result(timeout=10)
  assert engine.log[-2:] == ["flush", "generate x1"]
  worker.close()
