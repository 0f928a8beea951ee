"""EngineWorker: batches concurrent requests continuously (a request joins a running batch at
the next step; stepped completions equal whole ones), isolates a bad one, keeps control ops
ordered."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from bat_jax.rollout.engine import Completion, GenerateRequest, SamplingParams
from bat_jax.rollout.jax_engine import JaxEngine
from bat_jax.rollout.worker import EngineWorker
from rollout_fixtures import SMALL_ENGINE


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


class StepEngine:
  """Each next token is a function of the last one (so a request split into steps must give
  the tokens it gives whole); honours max_new_tokens, stop ids and a 40-token context, and
  logs every call's sessions."""

  max_len = 40
  weight_version = "7"

  def __init__(self, on_call=None):
    self.calls: list[list] = []
    self.log: list[str] = []
    self.known: dict = {}
    self.on_call = on_call

  def generate(self, requests):
    self.calls.append([r.session_id for r in requests])
    self.log.append("generate")
    if self.on_call is not None:
      self.on_call(len(self.calls))
    out = []
    for r in requests:
      ids = list(r.input_ids)
      known = self.known.get(r.session_id, ())
      cached = len(known) if tuple(ids[:len(known)]) == known else 0
      toks = []
      budget = min(r.sampling.max_new_tokens, self.max_len - len(ids))
      while len(toks) < budget:
        toks.append((ids[-1] * 7 + 3) % 50 + 1)
        ids.append(toks[-1])
        if toks[-1] in r.sampling.stop_token_ids:
          break
      self.known[r.session_id] = tuple(ids)
      reason = "stop" if toks and toks[-1] in r.sampling.stop_token_ids else "length"
      out.append(Completion(tuple(toks), tuple(-0.5 * t for t in toks), reason, len(r.input_ids),
                            cached, self.weight_version))
    return out

  def release(self, session_ids):
    self.log.append("release")


def _requests():
  return [GenerateRequest([3, 4], SamplingParams(max_new_tokens=10), "a"),      # budget
          GenerateRequest([9], SamplingParams(max_new_tokens=30, stop_token_ids=(17,)), "b"),
          GenerateRequest([5] * 30, SamplingParams(max_new_tokens=25), "c"),     # context
          GenerateRequest([2, 8], SamplingParams(max_new_tokens=1), "d")]


def test_stepped_requests_complete_as_whole_ones():
  whole = StepEngine().generate(_requests())
  assert [c.finish_reason for c in whole] == ["length", "stop", "length", "length"]
  assert len(whole[1].output_ids) < 30 and len(whole[2].output_ids) == 10   # stop; full
  worker = EngineWorker(StepEngine(), max_batch=4, step_tokens=3, batch_window_s=0.05)
  stepped = worker.generate_many(_requests(), timeout_s=10)
  assert stepped == whole
  assert worker.steps > 1 and max(worker.step_sizes) == 4
  worker.close()


def test_a_request_joins_a_running_batch_at_the_next_step():
  late = []

  def on_call(n):
    if n == 2:  # "a" is running: "b" arrives now
      late.append(worker.submit_generate(
          GenerateRequest([9], SamplingParams(max_new_tokens=4), "b")))

  engine = StepEngine(on_call)
  worker = EngineWorker(engine, max_batch=4, step_tokens=2)
  first = worker.submit_generate(GenerateRequest([3, 4], SamplingParams(max_new_tokens=12), "a"))
  result = first.result(timeout=10)
  assert len(result.output_ids) == 12 and late[0].result(timeout=10).output_ids
  assert engine.calls[:2] == [["a"], ["a"]]
  assert engine.calls[2] == ["a", "b"]                      # joined, not queued behind "a"
  assert ["a"] in engine.calls[4:]                          # "b" (2 steps) left before "a"
  assert result.cached_tokens == 0 and result.weight_version == "7"
  worker.close()


def test_release_runs_between_steps_and_control_calls_wait_for_running_requests():
  released = threading.Event()
  threads = []

  def on_call(n):  # on the worker thread: ask from other threads, as evaluator cells do
    if n == 2:
      threads.append(threading.Thread(target=lambda: (worker.release(["x"]), released.set())))
    if n == 6:
      threads.append(threading.Thread(target=lambda: worker.call(lambda e: e.log.append("flush"))))
    if n in (2, 6):
      threads[-1].start()

  engine = StepEngine(on_call)
  worker = EngineWorker(engine, max_batch=4, step_tokens=1)
  worker.submit_generate(GenerateRequest([3], SamplingParams(max_new_tokens=12))).result(10)
  for t in threads:
    t.join(10)
  assert released.is_set()
  log = engine.log
  assert 2 <= log[:log.index("release")].count("generate") < 12  # between the request's steps
  assert log[:log.index("flush")].count("generate") == 12         # waited for all of them
  worker.close()


def test_stepped_jax_engine_completions_are_bitwise_whole_ones(model):
  """The JAX engine continues each step from its cached slot: greedy tokens and logprobs equal
  one whole call's, however the requests share steps."""
  cfg = dataclasses.replace(SMALL_ENGINE, num_slots=4)
  greedy = SamplingParams(max_new_tokens=9, temperature=0.0)
  requests = [GenerateRequest(list(range(5, 5 + n)), dataclasses.replace(greedy, max_new_tokens=m),
                              f"s{n}") for n, m in ((3, 9), (20, 5), (11, 1), (7, 12))]
  whole = JaxEngine(model, cfg).generate(requests)
  worker = EngineWorker(JaxEngine(model, cfg), max_batch=4, step_tokens=4)
  stepped = worker.generate_many(requests, timeout_s=60)
  for w, s in zip(whole, stepped):
    assert (s.output_ids, s.logprobs, s.finish_reason) == (w.output_ids, w.logprobs,
                                                          w.finish_reason)
  assert worker.steps >= 3
  worker.close()


def test_closing_fails_the_running_requests_instead_of_leaving_them_waiting():
  def on_call(n):
    if n == 1:
      threading.Thread(target=worker.close).start()

  worker = EngineWorker(StepEngine(on_call), max_batch=4, step_tokens=1)
  running = worker.submit_generate(GenerateRequest([3], SamplingParams(max_new_tokens=30)))
  with pytest.raises(RuntimeError, match="worker was closed"):
    running.result(timeout=10)
