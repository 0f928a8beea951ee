"""Stage rubrics: equal-weight binary checklists scored from workspace files + the evidence log.

Only executed work counts. A workspace file is *produced* when the last evidence-log record that
changed it is a call that exited 0 and wrote exactly the bytes the file holds now; a receipt is
valid when it is produced and every file it names is produced and hash-matches. A stage with no
executed (exit 0) call that changed a file under its folders (`workflow.STAGE_DIRS`) has no
evidence: all its items and its score are null, which never counts as zero in aggregates (a
reward is a number, so there it is 0).

Only real content counts (`rubric.stages`): outputs must be the model's, the pipeline must run on
hidden probe cases, the submission must be the predictions in the native format. Hostile files
never make `score` raise: reads are bounded (`rubric.workspace`), and a check that still fails
on its input scores 0 with the reason in `RubricResult.details`.

`score` grades a finished trajectory: a stage-local row (focus S1..S5: that stage's checklist is
the reward) or an E2E row (reward = 0.5 * sum_s w_s S_s + 0.5 * task).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable, Optional

from bat_jax import workflow
from bat_jax.rubric import content
from bat_jax.rubric.stages import MIN_PLAN_CHARS, STAGE_CHECKS, names_subject
from bat_jax.rubric.workspace import MAX_READ_BYTES, EvidenceLike, Workspace
from bat_jax.taskkit import metrics
from bat_jax.taskkit.base import TaskInstance

__all__ = ["EvidenceLike", "MAX_READ_BYTES", "MIN_PLAN_CHARS", "RUBRIC_VERSION", "RubricResult",
           "Workspace", "names_subject", "score", "stage_checklist", "task_score"]

A = workflow.ARTIFACTS
# Bumped whenever what the checks accept changes (evaluation reports name it in their digest):
# v2 compares artifacts with the model's outputs and runs the pipeline on probe cases.
RUBRIC_VERSION = "content-v2"
# A check that raises on agent-made input scores 0 instead (RecursionError and MemoryError
# included: a hostile file must never end an evaluation or drop a training episode).
_CHECK_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                 ZeroDivisionError, RecursionError, MemoryError, OSError, UnicodeError)


@dataclasses.dataclass(frozen=True)
class RubricResult:
  stage_items: dict[str, dict[str, Optional[bool]]]
  stage_scores: dict[str, Optional[float]]
  task_score: Optional[float]
  reward: float
  # stage -> item -> why it scored 0 (an unreadable or made-up input); absent when it passed.
  details: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)


def _checked(inst: TaskInstance, stage: str, ws: Workspace
             ) -> tuple[dict[str, Optional[bool]], dict[str, str]]:
  items = workflow.stage_items(stage, inst.outcome)
  if not ws.stage_has_evidence(stage):
    return {i: None for i in items}, {}
  before = len(ws.notes)
  try:
    found = STAGE_CHECKS[stage](inst, ws)
  except _CHECK_ERRORS as e:
    ws.note(f"{stage} check could not read its input: {type(e).__name__}: {str(e)[:300]}")
    found = {i: False for i in items}
  if set(found) != set(items):
    raise AssertionError(f"{stage}/{inst.outcome}: checks {sorted(found)} != items {items}")
  reason = "; ".join(ws.notes[before:]) or "not met"
  return {i: bool(found[i]) for i in items}, {i: reason for i in items if not found[i]}


def stage_checklist(inst: TaskInstance, stage: str,
                    ws: Workspace) -> dict[str, Optional[bool]]:
  """{item: bool}, or {item: None} for every item when the stage has no evidence."""
  return _checked(inst, stage, ws)[0]


def _task_score(inst: TaskInstance, ws: Workspace) -> Optional[float]:
  handed = [f for f in ws.files_under(A["submission_dir"]) if f != A["submission_receipt"]]
  if not handed:
    return None
  if inst.outcome == "failure":
    items = STAGE_CHECKS["S5"](inst, ws)
    return float(items["failure_report_honest"] and items["no_fabricated_results"])
  sub = content.read_submission(inst, ws)
  if sub is None or not all(ws.produced(f) for f in handed):
    return 0.0
  ids = inst.hidden["case_ids"]
  truth = inst.hidden["truth"]
  vocabulary = inst.hidden.get("impressions", ())
  return sum(metrics.case_score(inst.track, truth[c], sub.get(c), impressions=vocabulary)
             for c in ids) / len(ids)


def task_score(inst: TaskInstance, ws: Workspace) -> Optional[float]:
  """The task's own metric; null when nothing was handed off under submission/.

  A failure task scores 1 for an honest failure report with nothing fabricated. Submission
  files not produced by an executed call, or that cannot be read, score 0.
  """
  try:
    return _task_score(inst, ws)
  except _CHECK_ERRORS as e:
    ws.note(f"task metric could not read the submission: {type(e).__name__}: {str(e)[:300]}")
    return 0.0


def score(instance: TaskInstance, focus: str, workspace: Path,
          evidence: Iterable[EvidenceLike]) -> RubricResult:
  """Scores a finished trajectory of a stage-local row (focus S1..S5) or an E2E row."""
  if focus not in workflow.FOCI:
    raise ValueError(f"unknown focus {focus!r}; expected one of {workflow.FOCI}")
  ws = Workspace(workspace, evidence)
  stages = workflow.STAGES if focus == workflow.E2E else (focus,)
  checked = {s: _checked(instance, s, ws) for s in stages}
  items = {s: checked[s][0] for s in stages}
  details = {s: checked[s][1] for s in stages if checked[s][1]}
  scores = {s: workflow.stage_score(items[s]) for s in stages}
  if focus == workflow.E2E:
    task = task_score(instance, ws)
    return RubricResult(items, scores, task, workflow.e2e_reward(scores, task), details)
  return RubricResult(items, scores, None, scores[focus] or 0.0, details)
