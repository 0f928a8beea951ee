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


# Wording varies widely across training tasks (the training side's own phrasings, drawn per task:
# opening, track sentence, facts label, closing, 0-2 neutral asides, and the order of the middle
# sentences), so a small policy learns that the wording carries nothing and the first call
# follows from the empty history: with five labels and four closings it keyed its first call on
# the training phrasings and, on the held-out teacher's own wording, opened with a later stage's
# call (experiments/README.md). The held-out teacher words its briefs differently again.
_MORE_OPENINGS = ("Here is a synthetic imaging task to carry out.",
                  "A practice study is set up in this workspace.",
                  "You are asked to run a small imaging pipeline.",
                  "This is a fictional study with a provided model.",
                  "Your job is one imaging task, start to finish.",
                  "A toy imaging project waits in the current directory.")
_TRACK_SENTENCES = ("Track: {track}.", "Track: {track}.", "Task type: {track}.",
                    "This is a {track} task.", "Kind of task: {track}.")
_FACTS_LABELS = ("Facts:", "Task facts:", "Key values:", "Workspace facts:", "Given:", "Ids:",
                 "Values:", "Task ids:", "Reference ids:", "Known values:")
_TOOL_CLOSINGS = (
    "Work through plan, setup, validate, infer and submit with the stage tools in tools/ (usage "
    "in task/spec.json); an artifact counts only if a tool call you run writes it.",
    "Use the stage tools in tools/ for the five stages in order (their usage is in "
    "task/spec.json); only artifacts written by your own tool calls count.",
    "Run plan, setup, validate, infer and submit one after another with the CLIs in tools/ "
    "(see task/spec.json); nothing counts unless a call you ran wrote it.",
    "Do every stage, from planning to the hand-off, with the scripts in tools/; artifacts earn "
    "credit only when your calls produce them.",
    "The tools/ folder has one command per stage; call them in order and let them write the "
    "artifacts.",
    "Go from the plan to the submission with the stage commands in tools/ (task/spec.json "
    "documents them).",
    "Each stage has its script under tools/; results only count when your own calls make them.",
    "Use tools/ for every stage; task/spec.json lists what each command takes.",
)
_ASIDES = ("The data are fictional.", "Nothing here needs the network.",
           "Keep every step reproducible.", "Report problems honestly.",
           "The workspace is a sandbox.", "Stay inside the current directory.",
           "Only executed calls earn credit.", "Work carefully and in order.",
           "No human will check in between.", "Time is not critical.",
           "All paths are relative to the workspace.", "The model is already provided.")


def tools_brief(instance: TaskInstance) -> str:
  """The E2E user message of a stage-tools task: the facts line and the tools, in wording drawn
  per task (`_FACTS_LABELS` ... `_ASIDES`)."""
  rng = random.Random(instance.task_id)
  track = rng.choice(_TRACK_SENTENCES).format(track=instance.track)
  facts = f"{rng.choice(_FACTS_LABELS)} {toolspace.task_facts(instance)}."
  middle = [track, instance.spec["objective"], facts]
  if rng.random() < 0.3:
    middle = [track, facts, instance.spec["objective"]]
  sentences = [rng.choice(_OPENINGS + _MORE_OPENINGS), *middle, rng.choice(_TOOL_CLOSINGS)]
  for aside in rng.sample(_ASIDES, rng.choice((0, 0, 1, 2))):
    sentences.insert(rng.randint(1, len(sentences)), aside)
  return " ".join(sentences)


def _handoff(focus: str) -> str:
  done = workflow.STAGES[:workflow.STAGES.index(focus)]
  if len(done) == 1:
    return f"Stage {done[0]} is already done: its artifacts are in the workspace. "
  return (f"Stages {', '.join(done)} are already done: their artifacts are in the workspace. "
          if done else "")


def tools_handoff(instance: TaskInstance, focus: str) -> str:
  """The stage-tools handoff of a stage-local row past S1: the earlier stages' calls in order, as
  their receipts in the workspace record them, with what validation last printed after its
  call (the observation an episode would have shown), so the row's first call is decidable:
  the next call follows from the last one and its printout, as in an episode."""
  done = workflow.STAGES[:workflow.STAGES.index(focus)]
  if not done:
    return ""
  calls = []
  for stage in done:
    stage_calls = [action["arguments"]["code"]
                   for action in toolspace.tool_actions(instance, stage)]
    if stage == "S3":  # S3 ends with the validation whose printout decides the next call
      stage_calls[-1] += f", which printed: {toolspace.validation_report(instance)}"
    calls += stage_calls
  return f"The earlier stages are done. Calls run: {'; '.join(calls)}. "


# Why a stage-tools row past S1 names neither its stage nor its tool: in an episode the next call
# follows from the calls before it and what they printed (after `validation ok`, infer; after
# infer, submit rather than stop), and the held-out cells fail on exactly those choices. A row
# that names its tool never poses them, so its practice was exact and taught the episode nothing
# (experiments/README.md, "Handoffs that pose the episode's choice").
_NEXT_STAGE = "Continue the workflow: do the next stage only, with its stage tool."


def brief_for(instance: TaskInstance, focus: str) -> str:
  """The user message of a row: the E2E brief, or a stage-local brief for S1..S5."""
  if focus == workflow.E2E:
    return instance.brief
  if focus not in workflow.STAGE_GOALS:
    raise ValueError(f"unknown focus {focus!r}; expected one of {workflow.FOCI}")
  if instance.action_space == "stage_tools":
    facts = f"Track: {instance.track}. Facts: {toolspace.task_facts(instance)}. "
    if focus == workflow.STAGES[0]:
      return (f"{facts}Do stage {focus} ({workflow.STAGE_NAMES[focus]}) only, with its stage "
              f"tool: {workflow.STAGE_TOOLS[focus]}.")
    return f"{facts}{tools_handoff(instance, focus)}{_NEXT_STAGE}"
  return (f"Track: {instance.track}. {instance.spec['objective']} Read "
          f"{workflow.ARTIFACTS['spec']} first. {_handoff(focus)}Do stage {focus} "
          f"({workflow.STAGE_NAMES[focus]}) only: {workflow.STAGE_GOALS[focus]}. Every artifact "
          "counts only if code you run writes it.")
