"""A scripted / replay `Engine`: answers each turn from a script instead of a model.

What it is for: driving the REAL agent loop (chat format, masks, sandbox, rubric) with known
assistant turns -- e.g. replaying the expert solver's actions rendered in the model's tool-call
syntax -- to measure rollout throughput without a policy (`experiments/perf/rollout_decode.py`),
and to test the loop's bookkeeping with exact expected tokens and logprobs (tests/rollout).
It never samples; its logprobs are synthetic.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, Union

from bat_jax.rollout.engine import Completion, GenerateRequest

WEIGHT_VERSION = "scripted"

# (session index, turn index) -> assistant text (the stop token is appended), or
# (text, "length") for a turn cut before its end.
Script = Callable[[int, int], Union[str, tuple[str, str]]]


class _TextEncoder(Protocol):
  """The part of `bat_jax.model.chat_format.ChatFormat` the engine uses."""
  im_end_id: int

  def encode(self, text: str) -> list[int]:
    ...


class ScriptedEngine:
  """An `Engine` that answers turn k of every session with `script(session_index, k)`.

  Sessions are numbered in order of first appearance (an `AgentLoop` with `concurrency` > 1
  starts its trajectories in a racy order: a script that keys on the session runs it at 1). Logprobs are distinct (-0.001 * running
  count) so tests can check that they land on the right tokens.

  Args:
    chat_format: encodes the scripted text (a `ChatFormat`).
    script: the answers (see `Script`).
    fail: session indices whose calls raise (engine-failure tests).
  """

  def __init__(self, chat_format: _TextEncoder, script: Script, *,
               fail: frozenset[int] = frozenset()):
    self.chat = chat_format
    self.script = script
    self.fail = fail
    self.sessions: dict[str, int] = {}
    self.turns: dict[str, int] = {}
    self.outputs: dict[int, list[list[int]]] = {}  # session index -> output ids per turn
    self.released: list[str] = []
    self._count = 0

  def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
    for r in requests:  # fail the whole call before any state changes, like a real batch
      if self.sessions.setdefault(r.session_id, len(self.sessions)) in self.fail:
        raise RuntimeError(f"engine failure for session {self.sessions[r.session_id]}")
    out = []
    for r in requests:
      idx = self.sessions[r.session_id]
      k = self.turns.get(r.session_id, 0)
      self.turns[r.session_id] = k + 1
      answer = self.script(idx, k)
      text, reason = answer if isinstance(answer, tuple) else (answer, "stop")
      ids = self.chat.encode(text) + ([self.chat.im_end_id] if reason == "stop" else [])
      ids = ids[:r.sampling.max_new_tokens]
      if reason == "stop" and ids[-1] != self.chat.im_end_id:
        reason = "length"
      logps = []
      for _ in ids:
        self._count += 1
        logps.append(-0.001 * self._count)
      self.outputs.setdefault(idx, []).append(ids)
      out.append(Completion(tuple(ids), tuple(logps), reason, len(r.input_ids),
                            weight_version=WEIGHT_VERSION))
    return out

  def release(self, session_ids: Sequence[str]) -> None:
    self.released.extend(session_ids)

  @property
  def weight_version(self) -> str:
    return WEIGHT_VERSION
