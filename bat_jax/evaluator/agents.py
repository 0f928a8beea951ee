"""The agent protocol the evaluator drives, and the built-in reference agents.

An agent is a callable: given the conversation so far as model-neutral messages
(`{"role": "system" | "user", "content"}`, `{"role": "assistant", "action": a, "content":
thought}`, `{"role": "tool", "content": observation}`), it returns a turn-like object with
`actions` (model-neutral `{"name": "execute_code", "arguments": {"language", "code"}}`; empty =
stop), `thought` and `error` (a malformed turn: shown back as the observation). The rollout
engine's `bat_jax.rollout.agent_loop.PolicyAgent` satisfies it. A cell builds its agent with an
`AgentFactory(instance)`; factories must be picklable (cells run in worker processes), and only
evaluator-side reference agents may look at the instance.

Built-ins: `oracle` (the expert solver), `null` (stops at once), `skip-S1` .. `skip-S5` (the
oracle, but it leaves none of that stage's own records: what later stages need to run is kept,
so each loses mainly its own stage -- proof that the rubric tells the stages apart).
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from bat_jax import workflow
from bat_jax.taskkit import Action, TaskInstance, expert_actions

A = workflow.ARTIFACTS

# Each stage's own records: what a skip-stage agent removes (later stages do not read them).
STAGE_RECORDS: Mapping[str, tuple[str, ...]] = {
    "S1": (A["plan"],),
    "S2": (A["environment"], A["compatibility"], A["checkpoint"]),
    "S3": (A["validation_output"], A["validation_receipt"]),
    "S4": (A["predictions_receipt"],),
    "S5": (A["submission_dir"],),
}


@dataclasses.dataclass(frozen=True)
class Turn:
  """One agent turn (same fields as the rollout engine's `AgentTurn`)."""
  actions: tuple[Mapping[str, Any], ...]
  thought: str = ""
  error: Optional[str] = None


class Agent(Protocol):
  def __call__(self, messages: Sequence[Mapping[str, Any]]) -> Any:
    """The next turn (an object with `actions`, `thought`, `error`)."""


AgentFactory = Callable[[TaskInstance], Agent]


def actions_taken(messages: Sequence[Mapping[str, Any]]) -> int:
  """How many actions the conversation already holds."""
  return sum(1 for m in messages if m.get("role") == "assistant" and "action" in m)


class ScriptedAgent:
  """Replays a fixed action list, one action per turn, then stops (stateless: it counts the
  actions already in the conversation)."""

  def __init__(self, actions: Sequence[Action]):
    self.actions = tuple(actions)

  def __call__(self, messages: Sequence[Mapping[str, Any]]) -> Turn:
    n = actions_taken(messages)
    if n >= len(self.actions):
      return Turn((), thought="All stages are done.")
    action = self.actions[n]
    return Turn(({"name": action["name"], "arguments": action["arguments"]},),
                thought=action.get("thought", ""))


def _remove_records(stage: str) -> Action:
  paths = " ".join(shlex.quote(p) for p in STAGE_RECORDS[stage])
  return {"name": workflow.TOOL_NAME,
          "arguments": {"language": "bash", "code": f"rm -rf {paths}\necho removed {paths}\n"},
          "thought": f"Skip the records of {stage}."}


def oracle_actions(instance: TaskInstance, skip_stage: Optional[str] = None) -> list[Action]:
  """The expert's actions for every stage; with `skip_stage`, that stage's records removed."""
  if skip_stage is not None and skip_stage not in workflow.STAGES:
    raise ValueError(f"unknown skip_stage {skip_stage!r}; expected one of {workflow.STAGES}")
  actions: list[Action] = []
  for stage in workflow.STAGES:
    actions += expert_actions(instance, stage)
    if stage == skip_stage:
      actions.append(_remove_records(stage))
  return actions


class OracleAgent(ScriptedAgent):
  """The expert solver (reference ceiling), optionally skipping one stage's records."""

  def __init__(self, instance: TaskInstance, skip_stage: Optional[str] = None):
    super().__init__(oracle_actions(instance, skip_stage))


class NullAgent:
  """Stops at once: no tool call, no artifact (reference floor)."""

  def __init__(self, instance: TaskInstance):
    del instance

  def __call__(self, messages: Sequence[Mapping[str, Any]]) -> Turn:
    del messages
    return Turn((), thought="Nothing to do.")


BUILTIN_AGENTS: tuple[str, ...] = ("oracle", "null") + tuple(f"skip-{s}" for s in workflow.STAGES)


def builtin_factory(name: str) -> AgentFactory:
  """The picklable factory of a built-in agent, by name."""
  if name == "oracle":
    return OracleAgent
  if name == "null":
    return NullAgent
  if name.startswith("skip-") and name[len("skip-"):] in workflow.STAGES:
    return functools.partial(OracleAgent, skip_stage=name[len("skip-"):])
  raise ValueError(f"unknown built-in agent {name!r}; expected one of {BUILTIN_AGENTS}")
