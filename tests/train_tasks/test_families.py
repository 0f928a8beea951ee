"""Training task families: determinism, variety, hidden answers kept out, briefs."""

import json

import pytest

from bat_jax import workflow
from bat_jax.taskkit import FAMILY_TYPES, metrics
from bat_jax.taskkit.scripts import checks
from bat_jax.train_tasks import FAMILIES, TRAIN_NAMES, brief_for

CELLS = [(t, o) for t in workflow.TRACKS for o in workflow.OUTCOMES]


def test_every_track_has_a_family_bound_to_the_training_names():
  assert set(FAMILIES) == set(workflow.TRACKS)
  assert all(f.track == t for t, f in FAMILIES.items())
  assert all(type(f) is FAMILY_TYPES[t] and f.names is TRAIN_NAMES for t, f in FAMILIES.items())


@pytest.mark.parametrize("track,outcome", CELLS)
def test_generate_is_deterministic_and_well_formed(track, outcome):
  a = FAMILIES[track].generate(3, outcome)
  b = FAMILIES[track].generate(3, outcome)
  assert a == b
  spec = a.spec
  assert spec["track"] == track and a.outcome == outcome and a.task_id == spec["task_id"]
  assert spec["data"]["index"] in a.files and spec["model"]["card"] in a.files
  hidden = a.hidden
  assert hidden["fault"] in (workflow.FAULTS[outcome] or (None,))
  # Hidden answers never enter the workspace.
  assert "truth" not in json.dumps(spec) and "expected" not in json.dumps(spec)
  for rel, data in a.files.items():
    assert not rel.startswith("/") and ".." not in rel
    for cid in hidden["case_ids"]:
      truth = hidden["truth"][cid]
      if not isinstance(truth, str):  # labels / answers legitimately occur in model files
        assert json.dumps(truth).encode() not in data, (rel, cid)
  # The provided model is right on clean data, and validation exposes degeneracy.
  for cid in hidden["case_ids"]:
    assert metrics.case_score(track, hidden["truth"][cid], hidden["expected"][cid]) >= 0.97
  good = [hidden["expected"][c] for c in hidden["validation_ids"] if c not in hidden["excluded"]]
  assert len(good) >= 2 and not checks.degenerate(good, spec["prediction_schema"])
  assert all(checks.prediction_ok(p, spec["prediction_schema"]) for p in good)
  # Briefs point at the spec and never carry answers.
  for focus in workflow.FOCI:
    text = brief_for(a, focus)
    assert workflow.ARTIFACTS["spec"] in text
    assert hidden["case_ids"][0] not in text


@pytest.mark.parametrize("track", workflow.TRACKS)
def test_values_and_names_vary_across_seeds(track):
  tasks = [FAMILIES[track].generate(s, "success") for s in range(12)]
  for key in (lambda t: t.hidden["case_ids"][0], lambda t: t.spec["data"]["index"],
              lambda t: t.spec["model"]["card"], lambda t: t.hidden["weights"],
              lambda t: t.task_id, lambda t: json.dumps(t.hidden["truth"])):
    assert len({key(t) for t in tasks}) >= 6
  assert len({t.hidden["n_cases"] for t in tasks}) >= 2
  assert len({t.hidden["maxval"] for t in tasks}) >= 2


def test_unknown_outcome_is_named():
  with pytest.raises(ValueError, match="partly"):
    FAMILIES["vqa"].generate(0, "partly")


def test_stage_tools_briefs_vary_their_wording_but_never_the_heldout_one():
  from bat_jax import train_tasks
  from bat_jax.evaluator import generators
  from bat_jax.taskkit import toolspace
  heldout = generators.generate("vqa", 3, "success", "lite", "stage_tools")
  heldout_tail = heldout.brief.rsplit(toolspace.task_facts(heldout), 1)[-1]
  closings = set()
  for seed in range(40):
    instance = train_tasks.generate("vqa", seed, "success", "stage_tools")
    head, tail = instance.brief.rsplit(toolspace.task_facts(instance), 1)
    closings.add(tail)
    assert tail != heldout_tail and "Study facts:" not in head
  assert len(closings) >= 3
