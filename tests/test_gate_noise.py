"""The gate's paired noise allowance on per-track drops (`track_noise_z`), end to end from the
evaluator's aggregation: per-cell scores in a digest order, paired SEs, the widened limits."""

import dataclasses
import random

import pytest

from bat_jax import gate, workflow
from bat_jax.evaluator import aggregation
from bat_jax.evaluator.cells import Cell
from bat_jax.evaluator.firewall import FirewallError, check_report
from bat_jax.gate import GateThresholds, UnpairedReportsError

DIGESTS = {"protocol_digest": "a" * 64, "cell_set_digest": "b" * 64}
CELLS = [Cell(t, o, 100 + 7 * i + j, "lite") for i, t in enumerate(workflow.TRACKS)
         for j, o in enumerate(workflow.OUTCOMES * 2)]   # 6 cells a track
NOISY = GateThresholds(track_noise_z=2.0)


def _record(cell: Cell, overall: float) -> dict:
  return {"cell": dataclasses.asdict(cell), "valid": True, "invalid_reason": None,
          "stage_scores": {s: 0.5 for s in workflow.STAGES}, "task_score": 0.5,
          "agentic": 0.5, "overall": overall,
          "stage_evidence": {s: True for s in workflow.STAGES}, "submitted": True,
          "finish_reason": "agent_stop", "malformed_turns": 0, "turns": 3, "tool_calls": 3}


def _report(scores: dict) -> dict:
  """The evaluator's aggregate over CELLS, cell c scoring scores.get(c, 0.6) overall."""
  records = [_record(c, scores.get(c, 0.6)) for c in CELLS]
  random.Random(len(scores)).shuffle(records)   # cells finish in any order
  return aggregation.aggregate(records, tier="lite", **DIGESTS)


def _vqa(k: int) -> Cell:
  return [c for c in CELLS if c.track == "vqa"][k]


def test_cell_overall_is_in_one_order_whatever_the_finishing_order():
  scores = {c: 0.1 * (i % 7) for i, c in enumerate(CELLS)}
  records = [_record(c, scores[c]) for c in CELLS]
  a = aggregation.aggregate(records, tier="lite", **DIGESTS)
  b = aggregation.aggregate(records[::-1], tier="lite", **DIGESTS)
  check_report(a)
  for track in workflow.TRACKS:
    got = a["track_scores"][track]["cell_overall"]
    assert got == b["track_scores"][track]["cell_overall"]
    assert sorted(got) == sorted(scores[c] for c in CELLS if c.track == track)
    assert sum(got) / len(got) == pytest.approx(a["track_scores"][track]["overall"])


def test_one_cell_falling_is_noise_a_whole_track_falling_is_not():
  base = _report({})
  one_cell = _report({_vqa(0): 0.0})                          # vqa -0.10: one cell of six
  whole = _report({_vqa(k): 0.5 for k in range(6)})           # vqa -0.10: every cell
  plain = gate.check(base, one_cell, GateThresholds(), True)
  assert not plain.checks["track_drop/vqa"].ok                # the reference limit: 0.05
  noisy = gate.check(base, one_cell, NOISY, True).checks["track_drop/vqa"]
  # diffs (0.6, 0 x 5): SE = sd / sqrt(6) = 0.1, so the limit is 0.05 + 2 * 0.1.
  assert noisy.ok and noisy.value == pytest.approx(0.1)
  assert noisy.threshold == pytest.approx(0.25)
  held = gate.check(base, whole, NOISY, True)
  assert not held.checks["track_drop/vqa"].ok                 # SE 0: the plain limit
  assert held.checks["track_drop/vqa"].threshold == pytest.approx(0.05)
  assert any(r.startswith("track_drop/vqa: 0.1000 > 0.05 ") for r in held.reasons)


def test_the_allowance_never_touches_overall_task_or_stage_checks():
  base = _report({})
  worse = _report({c: 0.0 for c in CELLS if c.outcome == "failure"})
  plain = gate.check(base, worse, GateThresholds(), True)
  noisy = gate.check(base, worse, NOISY, True)
  for name in ("overall_drop", "task_drop", "catastrophic_overall_drop"):
    assert noisy.checks[name] == plain.checks[name]
  assert not noisy.passed and not noisy.checks["overall_drop"].ok


def test_without_per_cell_scores_the_plain_limit_applies():
  base, cand = _report({}), _report({_vqa(0): 0.0})
  del base["track_scores"]["vqa"]["cell_overall"]             # e.g. an external evaluator
  check = gate.check(base, cand, NOISY, True).checks["track_drop/vqa"]
  assert not check.ok and check.threshold == pytest.approx(0.05)


def test_per_cell_lists_of_other_lengths_are_refused():
  base, cand = _report({}), _report({})
  cand["track_scores"]["vqa"]["cell_overall"] = cand["track_scores"]["vqa"]["cell_overall"][:5]
  with pytest.raises(UnpairedReportsError, match="cell_overall: lists differ in length"):
    gate.check(base, cand, NOISY, True)


@pytest.mark.parametrize("value, match", [
    ("0.5", r"cell_overall: must be a list"),
    ([0.5, 1.5], r"cell_overall\[1\]: must be a score"),
    ([None], r"cell_overall\[0\]: must be a score in \[0, 1\], got null"),
    ([{"seed": 3}], r"cell_overall\[0\]: must be a score"),
    ([0.5] * 7, r"cell_overall: must list one score per cell \(6\), got 7"),
])
def test_firewall_admits_only_scores_in_cell_overall(value, match):
  rep = _report({})
  rep["track_scores"]["vqa"]["cell_overall"] = value
  with pytest.raises(FirewallError, match=match):
    check_report(rep)


def test_noise_z_is_validated_and_off_in_the_reference():
  assert GateThresholds().track_noise_z == 0.0
  assert GateThresholds.from_config({"track_noise_z": 2.0}).track_noise_z == 2.0
  with pytest.raises(ValueError, match="gate.track_noise_z"):
    GateThresholds(track_noise_z=-1.0)
