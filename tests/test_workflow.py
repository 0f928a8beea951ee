"""The public workflow contract: stages, items per outcome, scoring formulas."""

import math

import pytest

from bat_jax import workflow


def test_reference_stage_weights_tracks_outcomes():
  assert workflow.STAGES == ("S1", "S2", "S3", "S4", "S5")
  assert dict(workflow.STAGE_WEIGHTS) == {"S1": 0.25, "S2": 0.15, "S3": 0.35, "S4": 0.15,
                                          "S5": 0.10}
  assert math.isclose(sum(workflow.STAGE_WEIGHTS.values()), 1.0)
  assert len(workflow.TRACKS) == 7 and workflow.OUTCOMES == ("success", "recovery", "failure")
  assert workflow.FOCI == ("E2E",) + workflow.STAGES
  assert set(workflow.TASK_METRICS) == set(workflow.TRACKS)


def test_items_per_outcome():
  assert workflow.stage_items("S3", "success") == (
      "small_case_executed", "output_shape_checked", "non_degeneracy_checked")
  assert workflow.stage_items("S3", "recovery")[-3:] == (
      "failure_diagnosed", "correction_executed", "corrected_result_verified")
  assert workflow.stage_items("S3", "failure") == ("small_case_executed", "failure_diagnosed")
  assert workflow.stage_items("S4", "failure") == ("blocker_recorded", "no_fabricated_predictions")
  assert "failure_report_honest" in workflow.stage_items("S5", "failure")
  assert "submission_complete" not in workflow.stage_items("S5", "failure")
  for stage in workflow.STAGES:
    for outcome in workflow.OUTCOMES:
      assert workflow.stage_items(stage, outcome), (stage, outcome)  # every stage applies
  every_item = {i for items in workflow.STAGE_ITEMS.values() for i in items}
  assert set(workflow.ITEM_OUTCOMES) <= every_item
  assert all(set(o) <= set(workflow.OUTCOMES) for o in workflow.ITEM_OUTCOMES.values())


def test_unknown_names_are_named_in_errors():
  with pytest.raises(ValueError, match="S9"):
    workflow.stage_items("S9", "success")
  with pytest.raises(ValueError, match="partial"):
    workflow.stage_items("S1", "partial")
  with pytest.raises(ValueError, match="S0"):
    workflow.e2e_reward({"S0": 1.0}, 1.0)


def test_faults_and_artifacts():
  assert workflow.FAULTS["success"] == ()
  assert workflow.FAULTS["recovery"] and workflow.FAULTS["failure"]
  dirs = {d for ds in workflow.STAGE_DIRS.values() for d in ds}
  for key in ("plan", "environment", "pipeline", "validation_output", "predictions",
              "submission_receipt", "failure_report"):
    assert workflow.ARTIFACTS[key].split("/")[0] in dirs, key
  assert all(not p.startswith("/") and ".." not in p for p in workflow.ARTIFACTS.values())


def test_stage_score_null_is_not_zero():
  assert workflow.stage_score({"a": True, "b": False, "c": None}) == 0.5
  assert workflow.stage_score({"a": None}) is None
  assert workflow.stage_score({}) is None


def test_overall_and_e2e_reward():
  assert workflow.overall_score(0.4, 0.8) == pytest.approx(0.6)
  assert workflow.overall_score(None, 0.8) == pytest.approx(0.8)
  assert workflow.overall_score(None, None) is None
  full = {s: 1.0 for s in workflow.STAGES}
  assert workflow.e2e_reward(full, 1.0) == pytest.approx(1.0)
  # For a reward, a skipped stage costs its weight: no renormalising over what was done.
  assert workflow.e2e_reward({"S1": 1.0}, None) == pytest.approx(0.125)
  assert workflow.e2e_reward({s: None for s in workflow.STAGES}, None) == 0.0
  assert workflow.e2e_reward({**full, "S3": None}, 0.5) == pytest.approx(0.5 * 0.65 + 0.25)


def test_format_observation_cut_with_marker():
  short = workflow.format_observation(0, "hi", "")
  assert short == "exit_code=0\nstdout:hi\nstderr:"
  long = workflow.format_observation(1, "x" * 5000, "err")
  assert len(long) <= workflow.MAX_OBSERVATION_CHARS and "truncated" in long
  assert long.startswith("exit_code=1\nstdout:x")


def test_call_stage_names_the_stage_of_a_stage_tools_call():
  assert workflow.call_stage("python tools/fix.py --fault x --subject y") == "S3"
  assert workflow.call_stage("python3 ./tools/submit.py --to s1") == "S5"
  assert workflow.call_stage("python tools/infer.py --blocked missing_case") == "S4"
  for code in ("cat tools/infer.py", "python tools/kit.py", "python tools/infer.pyc",
               "echo python tools/infer.py"):
    assert workflow.call_stage(code) is None, code
