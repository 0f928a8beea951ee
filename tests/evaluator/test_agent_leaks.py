"""Adversarial: what the agent can learn about its cell, or fake, from inside or through it.

Class "what the agent can learn or fake": host paths and outcomes through the mount table and
folder names, outcomes through task ids, and lifting the aggregate by making its own cells
invalid. (Receipts that lie are in tests/test_rubric.py.)
"""

import dataclasses
import re

import pytest

from bat_jax import workflow
from bat_jax.evaluator import aggregation
from bat_jax.evaluator import generators
from bat_jax.evaluator.cells import Cell, make_cells
from bat_jax.evaluator.runner import _Job
from bat_jax.sandbox import Sandbox, SandboxLimits, materialize
from bat_jax.train_tasks import FAMILIES

# Cells keyed by a fixed run secret: without one make_cells draws a fresh secret, and the held-out
# strings (so the test) would change from run to run.
FIXED_SECRET = "01" * 32

DIGESTS = {"protocol_digest": "c" * 64, "cell_set_digest": "d" * 64}
_PROBE = ("cat /proc/self/mountinfo /proc/mounts /proc/1/mountinfo; pwd; readlink -f .; "
          "ls -la /; cat /proc/self/cgroup; cat /proc/1/cmdline | tr '\\0' ' '; env")


def test_the_sandbox_shows_no_host_path(require_bwrap, tmp_path):
  work = tmp_path / "records" / "work" / "vqa-failure-123456-lite"
  materialize({"task/spec.json": "{}"}, work / "workspace")
  sb = Sandbox(work / "workspace", SandboxLimits(wall_s=20.0),
               evidence_path=work / "evidence.jsonl")
  r = sb.execute("bash", _PROBE)
  assert r.exit_code == 0 and "/workspace" in r.stdout
  for secret in ("vqa", "failure", "123456", "records", tmp_path.name, "pytest", str(tmp_path)):
    assert secret not in r.stdout, secret
  assert (work / "workspace" / "task" / "spec.json").read_text() == "{}"  # back in place


def test_evaluator_work_folders_are_opaque():
  cells = make_cells(7, 3, "lite", secret=FIXED_SECRET)
  job = _Job(None, "/r", None, None, False, "k" * 32)
  other = _Job(None, "/r", None, None, False, "j" * 32)
  names = {job.work_dir(c).name for c in cells}
  assert len(names) == len(cells)
  for c in cells:
    name = job.work_dir(c).name
    assert re.fullmatch(r"[0-9a-f]{16}", name)
    assert str(c.seed) not in name and c.outcome not in name and c.track not in name
    assert other.work_dir(c).name != name  # keyed per run: not derivable from the cell


@pytest.mark.parametrize("track", workflow.TRACKS)
def test_task_ids_carry_no_outcome_and_no_split(track):
  ids = {}
  for outcome in workflow.OUTCOMES:
    train = FAMILIES[track].generate(3, outcome)
    held = generators.generate(track, 3, outcome, "lite")
    ids[outcome] = (train.task_id, held.task_id)
    for tid, inst in ((train.task_id, train), (held.task_id, held)):
      assert re.fullmatch(r"task-[0-9a-f]{14}", tid), tid  # one form for both splits
      assert outcome not in tid and track not in tid
      spec = inst.files[workflow.ARTIFACTS["spec"]].decode()
      assert f'"task_id": "{tid}"' in spec
  assert len({i for pair in ids.values() for i in pair}) == 2 * len(workflow.OUTCOMES)


def _record(cell, overall, valid=True, reason="crash"):
  if not valid:
    return {"cell": dataclasses.asdict(cell), "valid": False, "invalid_reason": reason,
            "detail": "", "duration_s": 0.0}
  return {"cell": dataclasses.asdict(cell), "valid": True, "invalid_reason": None,
          "stage_scores": {s: overall for s in workflow.STAGES}, "task_score": overall,
          "agentic": overall, "overall": overall,
          "stage_evidence": {s: True for s in workflow.STAGES}, "submitted": True,
          "finish_reason": "agent_stop", "malformed_turns": 0, "turns": 3, "tool_calls": 3}


@pytest.mark.parametrize("reason", ["crash", "timeout", "sandbox_error", "parser_failure"])
def test_invalidating_its_own_failure_cells_does_not_lift_the_aggregate(reason):
  cells = [Cell(t, o, 10 + i, "lite") for i, t in enumerate(workflow.TRACKS[:2])
           for o in workflow.OUTCOMES]
  honest = [_record(c, 0.0 if c.outcome == "failure" else 1.0) for c in cells]
  gamed = [_record(c, 1.0, valid=c.outcome != "failure", reason=reason) for c in cells]
  base = aggregation.aggregate(honest, tier="lite", **DIGESTS)
  hit = aggregation.aggregate(gamed, tier="lite", **DIGESTS)
  assert base["overall"] == pytest.approx(2 / 3)
  assert hit["overall"] <= base["overall"] + 1e-9
  for track, scores in hit["track_scores"].items():
    assert scores["overall"] <= base["track_scores"][track]["overall"] + 1e-9
    assert scores["valid"] == 2 and scores["cells"] == 3
  for stage in workflow.STAGES:
    assert hit["stage_scores"][stage] <= base["stage_scores"][stage] + 1e-9
  assert hit["validity"] == {"valid": False, "valid_cells": 4, "invalid_cells": 2}
  assert aggregation.coverage_line(hit).startswith("valid coverage: 4/6 cells; 2 invalid")
  with pytest.raises(ValueError, match="2 invalid cell"):
    aggregation.require_complete(hit)  # and a gate still refuses it


def test_all_invalid_gives_null_scores_not_zero():
  cells = [Cell("vqa", o, 1, "lite") for o in workflow.OUTCOMES]
  rep = aggregation.aggregate([_record(c, 1.0, valid=False) for c in cells], tier="lite",
                             **DIGESTS)
  assert rep["overall"] is None and rep["track_scores"]["vqa"]["overall"] is None
