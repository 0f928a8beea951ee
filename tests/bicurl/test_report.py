"""The run report: standard errors over tracks, each round's target before/after, applied steps."""

import math

import pytest

from bat_jax import workflow
from bat_jax.bicurl.report import build_report, headline, markdown, standard_error
from bat_jax.bicurl.state import OuterState, RoundRecord


def _eval_report(track_overall):
  tracks = {t: {"overall": v, "stage_scores": {s: v / 2 for s in workflow.STAGES}}
            for t, v in zip(workflow.TRACKS, track_overall)}
  mean = sum(track_overall) / len(track_overall)
  return {"overall": mean, "task_score": mean, "agentic": mean,
          "stage_scores": {s: mean / 2 for s in workflow.STAGES}, "track_scores": tracks,
          "failure_categories": {}}


def test_standard_error_matches_the_formula():
  assert standard_error([1.0]) is None
  assert standard_error([0.0, 1.0]) == pytest.approx(0.5)
  xs = [0.1, 0.4, 0.2, 0.9]
  mean = sum(xs) / 4
  assert standard_error(xs) == pytest.approx(
      math.sqrt(sum((x - mean) ** 2 for x in xs) / 3 / 4))


def test_report_shows_standard_errors_targets_and_applied_steps():
  state = OuterState(sft_done=True, baseline="round_000000")
  state.evaluations["sft"] = headline(_eval_report([0.1, 0.3, 0.2, 0.4, 0.1, 0.2, 0.3]))
  state.evaluations["round_000000"] = headline(_eval_report([0.5] * 7))
  assert state.evaluations["sft"]["standard_errors"]["n"] == 7
  assert state.evaluations["round_000000"]["standard_errors"]["overall"] == 0.0
  state.rounds.append(RoundRecord(
      round=0, target="S2",
      weights={"pool_mix": {p: 1 / 3 for p in workflow.POOLS},
               "stage_weights": {s: float(s == "S2") for s in workflow.STAGES}},
      start_policy="sft", candidate="round_000000",
      gate={"passed": True, "reasons": [], "checks": {}}, promoted=True, healthy=True,
      steps=[{"reward_mean": 0.2, "no_signal": 0.0}, {"reward_mean": 0.0, "no_signal": 1.0}]))
  report = build_report(state)
  assert report["grpo_steps_applied"] == 1 and report["grpo_steps_total"] == 2
  (t,) = report["target_before_after"]
  assert t["target"] == "S2" and t["before"] == pytest.approx(0.8 / 7) and t["after"] == 0.25
  md = markdown(report)
  se = state.evaluations["sft"]["standard_errors"]["overall"]
  assert f"0.229 ± {se:.3f}" in md
  assert "| 0 | S2 | 0.114 | 0.250 |" in md
  assert "applied an update: 1 of 2" in md
