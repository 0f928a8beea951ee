"""The training side's brief wording: E2E briefs and the stage-local briefs of Stage Bank rows.

Briefs point at the spec and the public workflow (`bat_jax.workflow`), never at the answers.
"""

from __future__ import annotations

import random

from bat_jax import workflow
from bat_jax.taskkit import toolspace
from bat_jax.taskkit.base import TaskInstance

_OPENINGS = ("You are working on a fictional medical-imaging research task.",
             "A small imaging study needs your help.",
             "This workspace holds a self-contained research task.",
             "You have been handed an imaging analysis task.")


def make_brief(rng: random.Random, track: str, objective: str) -> str:
  """The E2E user message: points at the spec and the public workflow, not at the answers."""
  return (f"{rng.choice(_OPENINGS)} Track: {track}. {objective} Read "
          f"{workflow.ARTIFACTS['spec']} first: it names the data index, the model card, the "
          "small validation cases, the prediction schema, the submission format and the "
          "artifact paths. Work through the five stages (plan, setup, validate, infer, submit) "
          "with execute_code, write every artifact and receipt by running code, and if the "
          "task cannot be completed honestly, say so in a failure report instead of inventing "
          "results.")


# Wording varies across training tasks (the training side's own phrasings), so a small policy
# learns to find the facts and the stage tools in a brief rather than one fixed sentence; the
# held-out teacher words its briefs differently again.
_FACTS_LABELS = ("Facts:", "Task facts:", "Key values:", "Workspace facts:", "Given:")
_TOOL_CLOSINGS = (
    "Work through plan, setup, validate, infer and submit with the stage tools in tools/ (usage "
    "in task/spec.json); an artifact counts only if a tool call you run writes it.",
    "Use the stage tools in tools/ for the five stages in order (their usage is in "
    "task/spec.json); only artifacts written by your own tool calls count.",
    "Run plan, setup, validate, infer and submit one after another with the CLIs in tools/ "
    "(see task/spec.json); nothing counts unless a call you ran wrote it.",
    "Do every stage, from planning to the hand-off, with the scripts in tools/; artifacts earn "
    "credit only when your calls produce them.",
)


def tools_brief(instance: TaskInstance) -> str:
  """The E2E user message of a stage-tools task: the facts line and the tools, briefly."""
  rng = random.Random(instance.task_id)
  opening, label, closing = (rng.choice(_OPENINGS), rng.choice(_FACTS_LABELS),
                             rng.choice(_TOOL_CLOSINGS))
  return (f"{opening} Track: {instance.track}. {instance.spec['objective']} {label} "
          f"{toolspace.task_facts(instance)}. {closing}")


def _handoff(focus: str) -> str:
  done = workflow.STAGES[:workflow.STAGES.index(focus)]
  return (f"Stages {', '.join(done)} are already done: their artifacts are in the workspace. "
          if done else "")


def brief_for(instance: TaskInstance, focus: str) -> str:
  """The user message of a row: the E2E brief, or a stage-local brief for S1..S5."""
  if focus == workflow.E2E:
    return instance.brief
  if focus not in workflow.STAGE_GOALS:
    raise ValueError(f"unknown focus {focus!r}; expected one of {workflow.FOCI}")
  handoff = _handoff(focus)
  if instance.action_space == "stage_tools":
    return (f"Track: {instance.track}. Facts: {toolspace.task_facts(instance)}. {handoff}Do "
            f"stage {focus} ({workflow.STAGE_NAMES[focus]}) only, with its stage tool: "
            f"{workflow.STAGE_TOOLS[focus]}.")
  return (f"Track: {instance.track}. {instance.spec['objective']} Read "
          f"{workflow.ARTIFACTS['spec']} first. {handoff}Do stage {focus} "
          f"({workflow.STAGE_NAMES[focus]}) only: {workflow.STAGE_GOALS[focus]}. Every artifact "
          "counts only if code you run writes it.")
