"""Held-out generators: own names and values, tiers, contract kept, nothing shared with training."""

import json
import re

import pytest

from bat_jax import workflow
from bat_jax.evaluator import generators
from bat_jax.evaluator.markers_export import PUBLIC_NAMES
from bat_jax.taskkit import metrics
from bat_jax.train_tasks import FAMILIES

CELLS = [(t, o) for t in workflow.TRACKS for o in workflow.OUTCOMES]


@pytest.mark.parametrize("track,outcome", CELLS)
def test_generate_is_deterministic_and_keeps_the_contract(track, outcome):
  a = generators.generate(track, 5, outcome, "lite")
  assert a == generators.generate(track, 5, outcome, "lite")
  spec = a.spec
  assert re.fullmatch(r"task-[0-9a-f]{14}", a.task_id) and spec["task_id"] == a.task_id
  assert spec["track"] == track and spec["data"]["index"] in a.files
  assert a.hidden["fault"] in (workflow.FAULTS[outcome] or (None,))
  assert spec["submission"]["path"].startswith(workflow.ARTIFACTS["submission_dir"] + "/")
  for cid in a.hidden["case_ids"]:  # the provided model solves the clean cases
    assert metrics.case_score(track, a.hidden["truth"][cid], a.hidden["expected"][cid]) >= 0.97
  blob = b"".join(a.files.values())
  assert b"expected" not in a.files[workflow.ARTIFACTS["spec"]]
  if track == "report":  # rendered answers never enter the workspace
    assert all(t.encode() not in blob for t in a.hidden["expected"].values())


def test_tiers_differ_in_scaffolding_only():
  lite = generators.generate("segmentation", 2, "recovery", "lite")
  std = generators.generate("segmentation", 2, "recovery", "standard")
  assert lite.task_id == std.task_id and lite.hidden == std.hidden
  for stage in workflow.STAGES:
    assert workflow.STAGE_GOALS[stage] in lite.brief
    assert workflow.STAGE_GOALS[stage] not in std.brief
  assert "artifacts" in lite.spec and "artifacts" not in std.spec
  assert not set(generators.STANDARD_WITHHELD) & set(std.spec)
  assert workflow.ARTIFACTS["spec"] in std.brief and len(std.brief) < len(lite.brief) / 2
  with pytest.raises(ValueError, match="premium"):
    generators.generate("vqa", 0, "success", "premium")


def test_vqa_and_report_wording_is_the_evaluators():
  vqa = generators.generate("vqa", 1, "success", "lite")
  index = vqa.files[vqa.spec["data"]["index"]].decode()
  assert "hyperintense foci" in index or "midline" in index
  assert "How many" not in index and "Number of" not in index
  report = generators.generate("report", 1, "success", "lite")
  texts = list(report.hidden["expected"].values())
  assert all(t.startswith(("Assessment:", "OBSERVATIONS")) for t in texts)


def _names(instance):
  """Ids and file names of a task (public contract names excluded)."""
  spec = instance.spec
  found = {instance.task_id, *instance.hidden["case_ids"], spec["submission"]["path"]}
  found |= {v for k, v in spec["submission"].items() if k.endswith(("_key", "_column"))}
  for rel in instance.files:
    found.add(rel)
    found.update(rel.split("/"))
  found.update(json.loads(instance.files[spec["model"]["card"]])["requires"])
  return found - PUBLIC_NAMES - {"json", "math", "os"}


def test_training_and_heldout_share_no_ids_or_file_names():
  train, held = set(), set()
  for track in workflow.TRACKS:
    for outcome in workflow.OUTCOMES:
      for seed in range(12):
        train |= _names(FAMILIES[track].generate(seed, outcome))
        held |= _names(generators.generate(track, seed, outcome, "lite"))
  assert len(held) > 1000 and len(train) > 1000
  assert train & held == set()


def test_heldout_labels_and_values_differ_from_training():
  t = FAMILIES["classification"].generate(0, "success")
  h = generators.generate("classification", 0, "success", "lite")
  assert set(h.spec["prediction_schema"]["labels"]) <= set(generators.HELDOUT_NAMES.labels)
  assert not set(h.spec["prediction_schema"]["labels"]) & set(t.spec["prediction_schema"]["labels"])
  assert json.dumps(t.hidden["truth"]) != json.dumps(h.hidden["truth"])
