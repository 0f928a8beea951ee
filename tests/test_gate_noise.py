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


def test_cell_stage_scores_follow_cell_overall_and_average_to_the_stage_scores():
  """Per stage, one score per cell in `cell_overall`'s order (an invalid cell 0): a cell's
  stage list entries and its overall sit at one index, and each track's lists average to its
  stage scores."""
  stages = lambda i: {s: round(0.1 * ((i + k) % 11), 1) for k, s in enumerate(workflow.STAGES)}
  records = []
  for i, c in enumerate(CELLS):
    r = dict(_record(c, 0.01 * (i + 1)), stage_scores=stages(i))
    if i == 5:
      r.update(valid=False, invalid_reason="crash")
    records.append(r)
  a = aggregation.aggregate(records, tier="lite", **DIGESTS)
  b = aggregation.aggregate(records[::-1], tier="lite", **DIGESTS)
  check_report(a)
  by_overall = {0.01 * (i + 1): stages(i) for i in range(len(CELLS)) if i != 5}
  for track in workflow.TRACKS:
    t = a["track_scores"][track]
    assert t["cell_stage_scores"] == b["track_scores"][track]["cell_stage_scores"]
    for k, overall in enumerate(t["cell_overall"]):
      want = by_overall.get(overall, {s: 0.0 for s in workflow.STAGES})   # the invalid cell
      assert {s: t["cell_stage_scores"][s][k] for s in workflow.STAGES} == want
    for s in workflow.STAGES:
      assert sum(t["cell_stage_scores"][s]) / t["cells"] == pytest.approx(t["stage_scores"][s])


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(S6=[0.5] * 6), r"cell_stage_scores\.S6: is not an allowed field"),
    (lambda c: c.pop("S4"), r"cell_stage_scores.* missing"),
    (lambda c: c.update(S2=[0.5] * 5), r"cell_stage_scores\.S2: must list one score per cell "
                                       r"\(6\), got 5"),
    (lambda c: c.update(S3=["0.5"] * 6), r"cell_stage_scores\.S3\[0\]: must be a score"),
])
def test_firewall_admits_only_per_cell_scores_of_every_stage(edit, match):
  rep = _report({})
  edit(rep["track_scores"]["vqa"]["cell_stage_scores"])
  with pytest.raises(FirewallError, match=match):
    check_report(rep)


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
