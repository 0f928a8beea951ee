"""Promotion gate: every threshold at its boundary, pairing refusal, nulls and bad reports."""

import copy
import json

import pytest

from bat_jax import gate
from bat_jax.gate import GateThresholds, UnpairedReportsError
from bat_jax.workflow import STAGES, TRACKS

REF = GateThresholds()
EPS = 1e-6      # "just inside" / "just outside": far above the 1e-9 tolerance


def report(level: float = 0.8, digest: str = "cells-abc") -> dict:
  return {
      "stage_scores": {s: level for s in STAGES},
      "task_score": level,
      "agentic_score": level,
      "overall": level,
      "track_scores": {t: level for t in TRACKS},
      "protocol_digest": digest,
  }


def set_field(rep: dict, path: str, value) -> dict:
  rep = copy.deepcopy(rep)
  *parents, leaf = path.split(".")
  node = rep
  for p in parents:
    node = node[p]
  node[leaf] = value
  return rep


# (check name, report field it reads, reference limit, strict "<")
CHECKS = [
    ("overall_drop", "overall", 0.01, False),
    ("task_drop", "task_score", 0.03, False),
    ("track_drop/segmentation", "track_scores.segmentation", 0.05, False),
    ("track_drop/enhancement", "track_scores.enhancement", 0.05, False),
    ("stage_drop/S3", "stage_scores.S3", 0.03, False),
    ("stage_drop/S4", "stage_scores.S4", 0.03, False),
    ("stage_drop/S5", "stage_scores.S5", 0.03, False),
    ("catastrophic_overall_drop", "overall", 0.20, True),
]


def isolate(name: str) -> GateThresholds:
  """Reference thresholds, with the overall limit loosened when testing the catastrophic one."""
  if name == "catastrophic_overall_drop":
    return GateThresholds(max_overall_drop=0.5)
  return REF


@pytest.mark.parametrize("name, field, limit, strict", CHECKS)
def test_each_threshold_at_its_boundary(name, field, limit, strict):
  base = report(0.8)
  thresholds = isolate(name)
  # The limit itself, computed the way a real drop is (0.8 - (0.8 - limit) is not exactly limit).
  at = gate.check(base, set_field(base, field, 0.8 - limit), thresholds, True)
  inside = gate.check(base, set_field(base, field, 0.8 - limit + EPS), thresholds, True)
  outside = gate.check(base, set_field(base, field, 0.8 - limit - EPS), thresholds, True)
  assert inside.passed and inside.checks[name].ok and not inside.reasons
  assert not outside.passed and not outside.checks[name].ok
  assert any(r.startswith(name) for r in outside.reasons)
  assert outside.checks[name].value == pytest.approx(limit + EPS)
  assert outside.checks[name].threshold == limit
  # "drop <= limit" admits the limit; the catastrophic "drop < limit" does not.
  assert at.passed is (not strict) and at.checks[name].ok is (not strict)


def test_float_representation_at_a_threshold_is_absorbed():
  base = report(0.8)
  cand = set_field(base, "overall", 0.79)
  assert 0.8 - 0.79 > 0.01                      # the representation issue being tested
  decision = gate.check(base, cand, REF, True)
  assert decision.passed
  strict = gate.check(base, cand, GateThresholds(tolerance=0.0), True)
  assert not strict.passed and not strict.checks["overall_drop"].ok


def test_reference_thresholds_and_unguarded_stages():
  assert (REF.max_overall_drop, REF.max_task_drop, REF.max_track_drop, REF.max_stage_drop,
          REF.catastrophic_overall_drop) == (0.01, 0.03, 0.05, 0.03, 0.20)
  assert REF.guarded_stages == ("S3", "S4", "S5")
  base = report(0.8)
  # S1 and S2 are not guarded: a large drop there alone does not hold the candidate.
  decision = gate.check(base, set_field(base, "stage_scores.S1", 0.1), REF, True)
  assert decision.passed and "stage_drop/S1" not in decision.checks


def test_improvement_passes_and_every_check_is_reported():
  base = report(0.5)
  decision = gate.check(base, report(0.9), REF, True)
  assert decision.passed and decision.reasons == ()
  expected = ({"overall_drop", "task_drop", "catastrophic_overall_drop", "training_healthy"}
              | {f"track_drop/{t}" for t in TRACKS} | {f"stage_drop/{s}" for s in ("S3", "S4",
                                                                                   "S5")})
  assert set(decision.checks) == expected
  assert decision.checks["overall_drop"].value == pytest.approx(-0.4)
  json.dumps(decision.to_dict())


def test_unhealthy_training_holds():
  decision = gate.check(report(), report(), REF, training_healthy=False)
  assert not decision.passed
  assert decision.checks["training_healthy"] == (False, True, False)
  assert decision.reasons == ("training_healthy: the round's training was not healthy",)


def test_several_failures_are_all_reasons():
  cand = set_field(set_field(report(0.8), "task_score", 0.5), "stage_scores.S4", 0.5)
  decision = gate.check(report(0.8), cand, REF, True)
  assert not decision.passed
  assert [r.split(":")[0] for r in decision.reasons] == ["task_drop", "stage_drop/S4"]


def test_nulls_are_never_zero():
  base, cand = report(0.8), report(0.8)
  both_null = gate.check(set_field(base, "stage_scores.S5", None),
                         set_field(cand, "stage_scores.S5", None), REF, True)
  assert both_null.passed and both_null.checks["stage_drop/S5"] == (None, 0.03, True)
  new_evidence = gate.check(set_field(base, "stage_scores.S5", None), cand, REF, True)
  assert new_evidence.passed
  lost = gate.check(base, set_field(cand, "stage_scores.S5", None), REF, True)
  assert not lost.passed and "null in the candidate" in lost.reasons[0]
  # A stage missing from the dict is null too.
  del cand["stage_scores"]["S3"]
  assert not gate.check(base, cand, REF, True).checks["stage_drop/S3"].ok


def test_nested_track_scores_are_read_from_overall():
  base = report(0.8)
  base["track_scores"] = {t: {"overall": 0.8, "task": 0.7} for t in TRACKS}
  cand = copy.deepcopy(base)
  cand["track_scores"]["vqa"]["overall"] = 0.7
  decision = gate.check(base, cand, REF, True)
  assert not decision.checks["track_drop/vqa"].ok and decision.checks["track_drop/report"].ok


# --- Pairing ---------------------------------------------------------------------------------

def test_different_digests_are_refused():
  with pytest.raises(UnpairedReportsError, match="protocol_digest differs"):
    gate.check(report(digest="a"), report(digest="b"), REF, True)
  base, cand = report(), report()
  base["cell_set_digest"], cand["cell_set_digest"] = "x", "y"
  with pytest.raises(UnpairedReportsError, match="cell_set_digest differs"):
    gate.check(base, cand, REF, True)


def test_missing_digest_is_refused():
  cand = report()
  del cand["protocol_digest"]
  with pytest.raises(UnpairedReportsError, match="candidate report has no 'protocol_digest'"):
    gate.check(report(), cand, REF, True)
  base = report()
  del base["protocol_digest"]
  with pytest.raises(UnpairedReportsError, match="neither report carries a pairing digest"):
    gate.check(base, cand, REF, True)


def test_missing_track_is_refused_by_name():
  cand = report()
  del cand["track_scores"]["detection"]
  with pytest.raises(UnpairedReportsError, match=r"missing from candidate \['detection'\]"):
    gate.check(report(), cand, REF, True)


def test_invalid_cells_are_refused():
  cand = report()
  cand["validity"] = {"valid": False, "valid_cells": 20, "invalid_cells": 1}
  with pytest.raises(UnpairedReportsError, match="candidate report has 1 invalid cell"):
    gate.check(report(), cand, REF, True)


def evaluator_report(level: float, stage_s4: float) -> dict:
  """A report in exactly the built-in evaluator's exported shape (checked by its firewall)."""
  stages = {s: (stage_s4 if s == "S4" else level) for s in STAGES}
  track = {"overall": level, "task": level, "agentic": level, "stage_scores": stages,
           "cells": 3, "valid": 3}
  return {
      "schema": "bat_jax.evaluator.report/v2", "tier": "lite",
      "stage_scores": stages, "task_score": level, "agentic": level, "overall": level,
      "track_scores": {t: dict(track) for t in TRACKS},
      "completion": {"cells": 21, "valid": 21, "submitted": 21, "agent_stopped": 21,
                     "stage_evidence": {s: 21 for s in STAGES}},
      "failure_categories": {},
      "validity": {"valid": True, "valid_cells": 21, "invalid_cells": 0},
      "protocol_digest": "a" * 64, "cell_set_digest": "b" * 64,
  }


def test_gate_reads_the_evaluators_aggregate_report():
  from bat_jax.evaluator.firewall import check_report
  base, cand = evaluator_report(0.8, 0.8), evaluator_report(0.8, 0.7)
  check_report(base)
  check_report(cand)
  decision = gate.check(base, cand, REF, True)
  assert not decision.passed and not decision.checks["stage_drop/S4"].ok
  assert decision.checks["track_drop/vqa"].value == pytest.approx(0.0)
  assert gate.check(base, evaluator_report(0.8, 0.78), REF, True).passed


# --- Malformed input and config --------------------------------------------------------------

@pytest.mark.parametrize("path, value, match", [
    ("stage_scores.S3", "0.5", "candidate.stage_scores.S3 must be a number"),
    ("overall", float("nan"), "candidate.overall must be finite"),
    ("track_scores.vqa", {"task": 0.5}, "candidate.track_scores.vqa has no 'overall'"),
])
def test_malformed_scores_are_named(path, value, match):
  with pytest.raises(ValueError, match=match):
    gate.check(report(), set_field(report(), path, value), REF, True)


def test_missing_report_field_and_unknown_names():
  cand = report()
  del cand["task_score"]
  with pytest.raises(ValueError, match="candidate report has no 'task_score'"):
    gate.check(report(), cand, REF, True)
  base, cand = report(), report()
  base["track_scores"]["xray"] = cand["track_scores"]["xray"] = 0.5
  with pytest.raises(ValueError, match=r"unknown track\(s\) \['xray'\]"):
    gate.check(base, cand, REF, True)


def test_thresholds_from_config_section():
  from ml_collections import ConfigDict
  section = ConfigDict({"max_overall_drop": 0.02, "guarded_stages": ["S4"]})
  t = GateThresholds.from_config(section)
  assert t.max_overall_drop == 0.02 and t.guarded_stages == ("S4",) and t.max_task_drop == 0.03
  with pytest.raises(ValueError, match=r"gate: unknown field\(s\) \['max_overal_drop'\]"):
    GateThresholds.from_config({"max_overal_drop": 0.02})
  with pytest.raises(ValueError, match="gate.max_track_drop: must be a finite number >= 0"):
    GateThresholds(max_track_drop=-0.1)
  with pytest.raises(ValueError, match=r"gate.guarded_stages: unknown stage\(s\) \['S9'\]"):
    GateThresholds(guarded_stages=("S9",))
