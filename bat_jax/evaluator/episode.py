"""One cell: an agent driven through the whole workflow in the sandbox, then scored.

The loop mirrors training rollouts: the same sandbox, limits, tool-call check, error texts and
finish reasons (`bat_jax.rollout_protocol`), one model-neutral action per assistant message, a
malformed turn shown back to the agent as its observation. The result is a cell record: a
plain dict that stays evaluator-side (records directory), never exported.

Validity. An infrastructure failure makes the cell *invalid* (`invalid_reason`), which keeps it
out of every aggregate instead of scoring it 0:
  - `crash`: the agent (or its factory) raised, or the worker process died;
  - `parser_failure`: the agent returned something that is not a turn (no `actions` sequence of
    `{"name", "arguments"}` mappings) -- the adapter failed, not the policy;
  - `sandbox_error`: the sandbox could not run (bubblewrap unavailable, I/O error);
  - `timeout`: the cell ran past its wall-clock budget (enforced by the runner).
A policy that writes malformed tool calls, stops early or hits a limit is *valid*: that is its
score.

Scoring. Every stage applies to an end-to-end cell, so a stage without evidence scores 0 here,
as in `workflow.e2e_reward` (renormalising over the stages an agent bothered to do would pay for
skipping); the raw rubric items keep their nulls in the record.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from pathlib import Path
from typing import Any, Mapping, Optional

from bat_jax import rubric, workflow
from bat_jax.evaluator.agents import AgentFactory
from bat_jax.evaluator.cells import Cell
from bat_jax.evaluator.firewall import INVALID_REASONS
from bat_jax.rollout_protocol import RolloutLimits, error_observation, tool_call_problem
from bat_jax.sandbox import SandboxLimits, SandboxUnavailableError, safe_fs
from bat_jax.taskkit import materialize_at

remove_quietly = safe_fs.remove_tree_quietly


class _Invalid(Exception):
  def __init__(self, reason: str, detail: str):
    super().__init__(detail)
    self.reason = reason


def invalid_record(cell: Cell, reason: str, detail: str, duration_s: float = 0.0) -> dict:
  """The record of a cell that could not be measured."""
  if reason not in INVALID_REASONS:
    raise ValueError(f"unknown invalid reason {reason!r}; expected one of {INVALID_REASONS}")
  return {"cell": dataclasses.asdict(cell), "valid": False, "invalid_reason": reason,
          "detail": detail[-4000:], "duration_s": round(duration_s, 3)}


def _check_turn(turn: Any) -> tuple[list[Mapping[str, Any]], str, Optional[str]]:
  """(actions, thought, error) of a turn; _Invalid('parser_failure') if it is not one."""
  actions = getattr(turn, "actions", None)
  if not isinstance(actions, (list, tuple)) or not all(
      isinstance(a, Mapping) and isinstance(a.get("arguments"), Mapping) for a in actions):
    raise _Invalid("parser_failure", f"agent returned {type(turn).__name__} {turn!r:.300}, not a "
                   "turn with an `actions` sequence of {name, arguments} mappings")
  thought, error = getattr(turn, "thought", "") or "", getattr(turn, "error", None)
  return list(actions), str(thought), (None if error is None else str(error))


def drive_episode(agent, sandbox, brief: str, limits: RolloutLimits) -> dict[str, Any]:
  """The turn loop; returns counters. Agent exceptions become _Invalid('crash')."""
  messages: list[dict[str, Any]] = [{"role": "system", "content": workflow.SYSTEM_PROMPT},
                                    {"role": "user", "content": brief}]
  turns = calls = malformed = 0
  finish = "max_turns"
  while turns < limits.max_assistant_turns:
    try:
      turn = agent(messages)
    except Exception as e:  # the adapter / engine broke: not the policy's score
      raise _Invalid("crash", f"agent raised {type(e).__name__}: {e}\n"
                     f"{traceback.format_exc()}") from None
    actions, thought, error = _check_turn(turn)
    turns += 1
    if error is not None:
      malformed += 1
      messages += [{"role": "assistant", "content": thought},
                   {"role": "tool", "content": error_observation(error)}]
      continue
    if not actions:
      finish = "agent_stop"
      break
    for action in actions:
      if calls >= limits.max_tool_calls:
        finish = "max_tool_calls"
        break
      messages.append({"role": "assistant", "action": dict(action), "content": thought})
      problem = tool_call_problem(action, limits)
      if problem is not None:
        malformed += 1
        messages.append({"role": "tool", "content": error_observation(problem)})
        continue
      calls += 1
      try:
        res = sandbox.execute(action["arguments"]["language"], action["arguments"]["code"])
      except (SandboxUnavailableError, OSError) as e:
        raise _Invalid("sandbox_error", f"{type(e).__name__}: {e}") from None
      obs = res.observation
      if len(obs) > limits.max_observation_chars:
        obs = workflow.format_observation(res.exit_code, res.stdout, res.stderr,
                                          limits.max_observation_chars)
      messages.append({"role": "tool", "content": obs})
    if finish == "max_tool_calls":
      break
  close = getattr(agent, "close", None)  # optional in the protocol (engine sessions)
  if callable(close):
    close()
  return {"turns": turns, "tool_calls": calls, "malformed_turns": malformed,
          "finish_reason": finish}


def _scores(result: rubric.RubricResult) -> dict[str, Any]:
  stage = {s: (0.0 if v is None else float(v)) for s, v in result.stage_scores.items()}
  agentic = sum(workflow.STAGE_WEIGHTS[s] * v for s, v in stage.items())
  task = 0.0 if result.task_score is None else float(result.task_score)
  return {"stage_scores": stage, "agentic": agentic, "task_score": task,
          "overall": workflow.overall_score(task, agentic),
          "stage_evidence": {s: v is not None for s, v in result.stage_scores.items()},
          "submitted": result.task_score is not None,
          "stage_items": result.stage_items,
          "stage_details": result.details}


def run_cell(cell: Cell, factory: AgentFactory, work_dir: Path, *,
             limits: RolloutLimits = RolloutLimits(),
             sandbox_limits: SandboxLimits = SandboxLimits(),
             keep_workspace: bool = False) -> dict[str, Any]:
  """Runs and scores one cell in `work_dir` (created; removed unless keep_workspace)."""
  start = time.monotonic()
  instance = cell.instance()
  try:
    try:
      sandbox = materialize_at(instance, workflow.E2E, work_dir, sandbox_limits)
    except (SandboxUnavailableError, OSError) as e:
      raise _Invalid("sandbox_error", f"{type(e).__name__}: {e}") from None
    try:
      agent = factory(instance)
    except Exception as e:
      raise _Invalid("crash", f"agent factory raised {type(e).__name__}: {e}") from None
    counters = drive_episode(agent, sandbox, instance.brief, limits)
    result = rubric.score(instance, workflow.E2E, sandbox.workspace, sandbox.evidence)
  except _Invalid as e:
    return invalid_record(cell, e.reason, str(e), time.monotonic() - start)
  finally:
    if not keep_workspace:
      remove_quietly(work_dir)
  return {"cell": dataclasses.asdict(cell), "task_id": instance.task_id, "valid": True,
          "invalid_reason": None, **counters, **_scores(result),
          "duration_s": round(time.monotonic() - start, 3)}
