"""The `stage_tools` action space: the tools a workspace ships, its facts line, its expert.

`with_stage_tools(instance)` turns a generated task into its stage-tools variant: the same data,
model, planted fault, spec and hidden answers, plus the stage CLIs under tools/ (stdlib code
assembled from `scripts/stage_tools.py`, `scripts/checks.py`, `scripts/submission.py` and the
pipeline sources the code expert writes in S2) and their usage in the spec. Both sides (training
`bat_jax.train_tasks`, held-out `bat_jax.evaluator.generators`) call it on their own instances, so
the tools are public machinery and the rubric is unchanged: the tools write the contract's
artifacts and receipts by executed calls.

`tool_actions(instance, stage)` is the expert in this space: one short call per step, its
arguments copied from the task facts (`task_facts`) or, for the reactive steps, from what an
earlier observation names (validate prints `fault: ... subject: ...`).

S1 is a two-step look-up, not a copy: the model folder holds one checkpoint per imaging
modality (`checkpoints`), the facts line lists them by modality (`weights: ct w3, mr w5, us w1`)
beside the task's own (`modality: mr`), and the plan names the task's. The policy must first
read the modality, then find that modality's id in the list, in an order drawn per task; the
other calls copy one value found by its key. (Until run h1 every call was a one-key copy and the
post-SFT policy scored S1 and S2 1.000 on every held-out cell; experiments/README.md, "A
two-step plan".)

The facts a call copies are short task ids (`card: c4; weights: w8; data: d2; ...`; the spec's
`ids` maps each to the real path or list, and the tools resolve them): a path such as
`models/helix-seg-4/card.json` is 9-17 pieces to a 1k-token tokenizer, different for every model
name, while ` c4` is always a letter and one digit, so copying it is one look-up. The digit is
drawn per task and kind from all ten, on both sides: a memorised id is right one time in ten on
training and held-out tasks alike, so only copying pays, and the held-out ids are tokens the
policy has written in training. (Until 2026-12-05 training drew even digits and held-out odd
ones: the SFT policy then wrote an even digit where a held-out brief said an odd one, and the same
policy scored S5 0.111 on its held-out cells and 0.444 on the same cells with even ids;
experiments/README.md, "One digit set for both sides".)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import shlex
from typing import Any

from bat_jax import workflow
from bat_jax.taskkit import sources
from bat_jax.taskkit.base import TaskInstance
from bat_jax.taskkit.pipeline_files import pipeline_sources
from bat_jax.taskkit.runners import common
from bat_jax.taskkit.scripts import checks, stage_tools, submission

A = workflow.ARTIFACTS
_ENTRY = "import sys\nfrom kit import main\nsys.exit(main({command!r}, sys.argv[1:]))\n"


@functools.cache
def tool_files() -> dict[str, bytes]:
  """relpath -> content of every file the stage tools ship (`workflow.STAGE_TOOL_FILES`)."""
  kit = sources.inline_source(checks, common.parse_pgm, common.format_pgm, submission,
                              stage_tools)
  files = {f"{workflow.TOOLS_DIR}/kit.py": kit}
  files.update({f"{workflow.TOOLS_DIR}/{c}.py": _ENTRY.format(command=c)
                for c in workflow.TOOL_COMMANDS})
  files.update({f"{workflow.TOOLS_DIR}/lib/{name}": text
                for name, text in pipeline_sources().items()})
  if set(files) != set(workflow.STAGE_TOOL_FILES):
    raise AssertionError(f"tool files {sorted(files)} != {workflow.STAGE_TOOL_FILES}")
  return {k: v.encode() for k, v in files.items()}


# The first letter of each kind of short id; the number follows (`_short_ids`).
ID_LETTERS = {"card": "c", "weights": "w", "data": "d", "validation": "v", "submission": "s"}
# The modalities a task's checkpoints are trained on; each model folder holds `N_CHECKPOINTS`
# of them, the task's own (the card's weights) and others, one id per modality.
MODALITIES = ("ct", "mr", "us", "xr", "pet")
N_CHECKPOINTS = 3


def _values(instance: TaskInstance) -> dict[str, str]:
  """The real value behind each short id: paths and the validation ids, all in the workspace."""
  spec = instance.spec
  card = json.loads(instance.files[spec["model"]["card"]])
  return {"card": spec["model"]["card"],
          "weights": f"{os.path.dirname(spec['model']['card'])}/{card['weights']}",
          "data": spec["data"]["dir"], "validation": ",".join(spec["validation_case_ids"]),
          "submission": spec["submission"]["path"]}


def _short_ids(task_id: str) -> dict[str, str]:
  """kind -> `<letter><digit>`, the digit drawn by (task, kind) from all ten.

  One digit, not two: a from-scratch 128-wide policy did not learn to copy two-digit ids in 250
  SFT steps (it emitted one memorised id: exact 1 of 32 validation calls, experiments/README.md),
  while a sampled one-of-10 digit is right often enough for GRPO groups to differ.
  """
  digest = lambda kind: int(hashlib.sha256(f"{task_id}|{kind}".encode()).hexdigest(), 16)
  return {kind: f"{letter}{digest(kind) % 10}" for kind, letter in ID_LETTERS.items()}


@dataclasses.dataclass(frozen=True)
class Checkpoints:
  """The checkpoints of a stage-tools task: its own modality, and (modality, short id, path)
  for each checkpoint in the order the facts line lists them."""
  modality: str
  listed: tuple[tuple[str, str, str], ...]


def _checkpoints(task_id: str, weights_rel: str, weights_id: str) -> Checkpoints:
  """The task's modality and its checkpoint list, drawn per task: the card's weights are the
  task modality's; the others sit beside them (`<stem>-<modality>.json`) under other ids."""
  rng = random.Random(f"{task_id}|checkpoints")
  modalities = rng.sample(MODALITIES, N_CHECKPOINTS)
  own, letter = modalities[0], ID_LETTERS["weights"]
  digits = rng.sample([d for d in range(10) if f"{letter}{d}" != weights_id], N_CHECKPOINTS - 1)
  stem = weights_rel.removesuffix(".json")
  entries = {own: (weights_id, weights_rel)}
  entries.update({m: (f"{letter}{d}", f"{stem}-{m}.json")
                  for m, d in zip(modalities[1:], digits)})
  order = rng.sample(modalities, N_CHECKPOINTS)
  return Checkpoints(own, tuple((m, *entries[m]) for m in order))


def _other_checkpoint(intact_weights: str, modality: str) -> bytes:
  """Another modality's checkpoint: loadable, never the task's (only the plan names one)."""
  blob = json.loads(intact_weights)
  return json.dumps(dict(blob, modality=modality), sort_keys=True).encode()


def short_id(instance: TaskInstance, value: Any) -> Any:
  """The short id standing for `value` in this task (`value` itself when none does)."""
  inverse = {real: short for short, real in instance.spec.get("ids", {}).items()}
  return inverse.get(value, value)


def facts(instance: TaskInstance) -> dict[str, Any]:
  """The values a stage-tools agent copies, all visible in the workspace (no hidden answers)."""
  if instance.action_space != "stage_tools":
    raise ValueError(f"{instance.task_id} is a {instance.action_space!r} task, not stage_tools")
  f = {kind: short_id(instance, v) for kind, v in _values(instance).items()}
  return {"card": f["card"], "modality": instance.spec["modality"], "weights": f["weights"],
          "data": f["data"], "cases": instance.hidden["n_cases"], "validation": f["validation"],
          "submission": f["submission"]}


def task_facts(instance: TaskInstance) -> str:
  """The facts line briefs quote: `card: ...; modality: mr; weights: ct w3, mr w5, us w1;
  data: ...; cases: N; ...` (every checkpoint by modality; the plan names the task's).

  Each value follows a space, as it does after its flag in a call (`--data data/x`), so a
  byte-level BPE tokenizer splits it the same way in both places (`=data` would be one token in
  `data=data/x` but ` data` in the call): copying it is copying tokens.
  """
  shown = dict(facts(instance))
  shown["weights"] = ", ".join(f"{m} {short_id(instance, path)}"
                               for m, path in instance.spec["checkpoints"])
  return "; ".join(f"{k}: {v}" for k, v in shown.items())


def with_stage_tools(instance: TaskInstance) -> TaskInstance:
  """The stage-tools variant of a `code` task (same task; tools, usage and short ids added)."""
  if instance.action_space != "code":
    raise ValueError(f"{instance.task_id}: already in action space {instance.action_space!r}")
  values, ids = _values(instance), _short_ids(instance.task_id)
  ckpts = _checkpoints(instance.task_id, values["weights"], ids["weights"])
  spec = dict(instance.spec, stage_tools=dict(workflow.STAGE_TOOLS),
              ids={ids[kind]: values[kind] for kind in ID_LETTERS},
              modality=ckpts.modality, checkpoints=[[m, path] for m, _, path in ckpts.listed])
  spec["ids"].update({short: path for _, short, path in ckpts.listed})
  files = dict(instance.files)
  files.update({path: _other_checkpoint(instance.hidden["probe"]["weights"], m)
                for m, _, path in ckpts.listed if m != ckpts.modality})
  files.update(tool_files())
  files[A["spec"]] = json.dumps(spec, indent=1, sort_keys=True).encode()
  return dataclasses.replace(instance, files=files, action_space="stage_tools")


def _call(command: str, thought: str, **flags: Any) -> dict[str, Any]:
  argv = " ".join(f"--{k} {shlex.quote(str(v))}" for k, v in flags.items())
  return {"name": workflow.TOOL_NAME,
          "arguments": {"language": "bash", "code": f"python tools/{command}.py {argv}"},
          "thought": thought}


def validation_report(instance: TaskInstance) -> str:
  """What validation last printed by the S3/S4 boundary (its stdout line, as the tool prints
  it): the handoff a stage-local S4 or S5 row states, since which call comes next (infer or
  record the blocker) follows from it. The full line for an unfixable fault, whose values the
  calls copy; its opening words for a passed validation."""
  if instance.outcome != "failure":
    return "validation ok"
  hidden = instance.hidden
  return stage_tools.fault_line(hidden["fault"], short_id(instance, hidden["fault_subject"]),
                                False)


def tool_actions(instance: TaskInstance, stage: str) -> list[dict[str, Any]]:
  """The expert's tool calls for one stage (S1..S5) of a stage-tools task.

  Every call follows from what the context shows: the facts line, or the validate line (in an
  episode its observation; in a stage-local S4 / S5 row the brief's handoff,
  `validation_report`), never from the outcome the task hides."""
  if instance.action_space != "stage_tools":
    raise ValueError(f"{instance.task_id} is a {instance.action_space!r} task, not stage_tools")
  f, hidden, outcome = facts(instance), instance.hidden, instance.outcome
  fault, subject = hidden["fault"], short_id(instance, hidden["fault_subject"])
  if stage == "S1":
    return [_call("plan", "Plan from the task facts.", weights=f["weights"], data=f["data"],
                  cases=f["cases"])]
  if stage == "S2":
    return [_call("setup", "Set up the model from its card.", card=f["card"])]
  if stage == "S3":
    validate = _call("validate", "Validate on the validation cases.", cases=f["validation"])
    if outcome != "recovery":
      return [validate]
    return [validate, _call("fix", "Fix the fault validation named.", fault=fault,
                            subject=subject),
            _call("validate", "Validate again after the fix.", cases=f["validation"])]
  if stage == "S4":
    if outcome == "failure":
      return [_call("infer", "Record the blocker.", blocked=fault)]
    return [_call("infer", "Infer over every case.", data=f["data"])]
  if stage == "S5":
    if outcome == "failure":
      return [_call("submit", "Hand off an honest failure report.", failed=fault,
                    subject=subject)]
    return [_call("submit", "Submit in the native format.", to=f["submission"])]
  raise ValueError(f"unknown stage {stage!r}; expected one of {workflow.STAGES}")
