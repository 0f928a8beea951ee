"""The run report: standard errors over tracks, each round's target before/after, applied steps."""

import itertools
import json
import math
from typing import Optional

import pytest

from bat_jax import workflow
from bat_jax.evaluator import aggregation
from bat_jax.bicurl.report import (build_report, headline, markdown, rewards_kl_figure,
                                  run_summary, standard_error)
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


def test_headline_is_the_same_from_the_report_and_from_its_json_file():
  """The file lists tracks sorted by name; the run that wrote it held them in `TRACKS` order.
  A rerun reads the file, so the headline (its standard errors too) must not depend on the
  order: one track at 0.1 among six at 0 gave 0.014285714285714289 one way, ...285 the other
  (the rerun test's failure under `pytest -n 2`)."""
  report = _eval_report([0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0])
  from_file = json.loads(json.dumps(report, sort_keys=True))
  assert list(from_file["track_scores"]) != list(report["track_scores"])
  assert headline(from_file) == headline(report)
  for values in itertools.permutations([0.1, 0.0, 0.0, 0.3, 0.7]):
    assert standard_error(list(values)) == standard_error([0.1, 0.0, 0.0, 0.3, 0.7])


def test_aggregate_means_do_not_depend_on_the_cells_finishing_order():
  values = [0.1, 0.7, 0.2, 0.3, 0.0, 0.9, 0.6]
  assert len({aggregation._mean(list(p)) for p in itertools.permutations(values)}) == 1


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


def test_each_rounds_pool_rewards_compare_its_first_and_last_third_of_steps():
  state = OuterState(sft_done=True, baseline="sft")
  state.evaluations["sft"] = headline(_eval_report([0.2] * 7))
  steps = [{"reward_mean": 0.0, "no_signal": 0.0, "reward_s_target": x, "reward_e2e": 1 - x}
           for x in (0.1, 0.2, 0.3, 0.5, 0.6, 0.9)]
  del steps[0]["reward_e2e"]
  state.rounds.append(RoundRecord(
      round=0, target="S4", start_policy="sft",
      weights={"pool_mix": {p: 1 / 3 for p in workflow.POOLS},
               "stage_weights": {s: float(s == "S4") for s in workflow.STAGES}},
      candidate="round_000000", gate={"passed": False, "reasons": [], "checks": {}},
      promoted=False, healthy=True, steps=steps))
  pools = build_report(state)["rounds"][0]["reward_by_pool"]
  assert pools["s_target"] == {"first": pytest.approx(0.15), "last": pytest.approx(0.75)}
  assert pools["e2e"] == {"first": pytest.approx(0.8), "last": pytest.approx(0.25)}
  assert pools["s_mix"] == {"first": None, "last": None}
  assert "| 0.150 → 0.750 |" in markdown(build_report(state))


def _finished_state():
  state = OuterState(sft_done=True, baseline="round_000000")
  state.evaluations["sft"] = headline(_eval_report([0.2] * 7))
  state.evaluations["round_000000"] = headline(_eval_report([0.4] * 7))
  state.rounds.append(RoundRecord(
      round=0, target="S3", weights={"pool_mix": {}, "stage_weights": {}},
      start_policy="sft", candidate="round_000000",
      gate={"passed": True, "reasons": [], "checks": {}}, promoted=True, healthy=True,
      steps=[{"reward_mean": 0.0, "no_signal": 1.0}, {"reward_mean": 0.0, "no_signal": 1.0}]))
  return state


def test_run_summary_is_short_and_says_where_the_artifacts_are(tmp_path):
  for name in ("sft", "round_000000"):
    (tmp_path / "policies" / name).mkdir(parents=True)
  text = run_summary(build_report(_finished_state()), tmp_path)
  lines = text.splitlines()
  assert len(lines) <= 8
  assert "sft 0.200 -> round_000000 0.400 (pass)" in lines[1]
  assert "0 of 2 GRPO steps applied; promoted policy round_000000" in lines[0]
  assert f"S1 {0.2:.3f}" in lines[2]
  assert str(tmp_path / "report.md") in text and str(tmp_path / "stage_scores.png") in text
  assert str(tmp_path / "rewards_kl.png") in text
  assert f"{tmp_path / 'policies'}/{{round_000000,sft}}" in text


def test_kl_plot_without_an_applied_update_shows_a_note_not_empty_axes():
  steps = build_report(_finished_state())["steps"]
  fig = rewards_kl_figure(steps)
  notes = [t.get_text() for t in fig.axes[1].texts]
  assert notes and "no GRPO update applied in 2 step(s)" in notes[0]
  applied = rewards_kl_figure([{"reward_mean": 0.3, "no_signal": 0.0, "kl": 0.01}])
  assert len(applied.axes[1].texts) == 0  # a real KL curve needs no note


def test_stage_reach_splits_each_stage_into_reach_and_its_mean_where_reached():
  """From the aggregate of real cell records: a cell that stopped after S3 scores 0 on S4 and
  S5, so S5 as reported is low while its mean over the cells that reached it is not."""
  def cell(track, scores):
    return {"cell": {"track": track}, "valid": True, "invalid_reason": None,
            "stage_scores": dict(zip(workflow.STAGES, scores)), "task_score": 0.5,
            "agentic": 0.5, "overall": 0.5, "finish_reason": "agent_stop",
            "malformed_turns": 0, "submitted": scores[4] > 0,
            "stage_evidence": {s: v > 0 for s, v in zip(workflow.STAGES, scores)}}
  records = [cell(workflow.TRACKS[0], [1.0, 1.0, 0.5, 1.0, 0.75]),
             cell(workflow.TRACKS[0], [1.0, 1.0, 1.0, 0.0, 0.0]),
             cell(workflow.TRACKS[1], [0.8, 1.0, 1.0, 0.0, 0.0]),
             cell(workflow.TRACKS[1], [0.8, 0.0, 0.0, 0.0, 0.0])]
  report = aggregation.aggregate(records, tier="lite", protocol_digest="a" * 64,
                                 cell_set_digest="b" * 64)
  reach = headline(report)["stage_reach"]
  assert reach["cells"] == 4
  assert reach["evidence"] == {"S1": 4, "S2": 3, "S3": 3, "S4": 1, "S5": 1}
  assert report["stage_scores"]["S5"] == pytest.approx(0.1875)
  assert reach["where_reached"] == pytest.approx(
      {"S1": 0.9, "S2": 1.0, "S3": 2.5 / 3, "S4": 1.0, "S5": 0.75})
  state = OuterState(sft_done=True, baseline="sft")
  state.evaluations["sft"] = headline(report)
  md = markdown(build_report(state))
  assert "| sft | 0.900 (4/4) | 1.000 (3/4) | 0.833 (3/4) | 1.000 (1/4) | 0.750 (1/4) |" in md
  # An aggregate with an invalid cell (its stage means count it as 0) gets no split.
  broken = dict(report, completion=dict(report["completion"], valid=3))
  assert headline(broken)["stage_reach"] is None
  assert "Where each stage was reached" not in markdown(build_report(OuterState(
      sft_done=True, baseline="sft", evaluations={"sft": headline(broken)})))


_CELLS = [(t, seed) for t in workflow.TRACKS[:2] for seed in range(3)]


def _cell(track: str, seed: int, overall: float, stages: Optional[dict] = None) -> dict:
  """A valid end-to-end cell record (its stages score `overall` unless given)."""
  return {"cell": {"track": track, "seed": seed}, "valid": True, "invalid_reason": None,
          "stage_scores": stages or {s: overall for s in workflow.STAGES},
          "task_score": overall, "agentic": overall, "overall": overall,
          "finish_reason": "agent_stop", "malformed_turns": 0, "submitted": True,
          "stage_evidence": {s: True for s in workflow.STAGES}}


def _one_round(before: list[dict], after: list[dict], passed: bool) -> OuterState:
  """SFT, then one S3 round, evaluated from aggregates of real cell records (the candidate's
  cells finishing in another order)."""
  state = OuterState(sft_done=True, baseline="round_000000" if passed else "sft")
  for name, records in (("sft", before), ("round_000000", after[::-1])):
    state.evaluations[name] = headline(aggregation.aggregate(
        records, tier="lite", protocol_digest="a" * 64, cell_set_digest="b" * 64))
  state.rounds.append(RoundRecord(
      round=0, target="S3", weights={"pool_mix": {p: 1 / 3 for p in workflow.POOLS},
                                     "stage_weights": {s: float(s == "S3")
                                                       for s in workflow.STAGES}},
      start_policy="sft", candidate="round_000000",
      gate={"passed": passed, "reasons": [] if passed else ["stage_drop/S3: 0.1667 > 0.03"],
            "checks": {}},
      promoted=passed, healthy=True, steps=[{"reward_mean": 0.2, "no_signal": 0.0}]))
  return state


def test_each_round_and_the_accepted_policy_show_their_paired_change():
  """From aggregates of real cell records: the change is the mean of the per-cell changes, and
  its standard error is that of the paired differences (one cell moved, the others did not)."""
  before = [_cell(t, s, 0.5) for t, s in _CELLS]
  after = [_cell(t, s, 0.8 if (t, s) == _CELLS[4] else 0.5) for t, s in _CELLS]
  state = _one_round(before, after, passed=True)
  report = build_report(state)
  se = standard_error([0.3, 0, 0, 0, 0, 0])
  assert report["rounds"][0]["change"] == pytest.approx({"mean": 0.05, "se": se, "cells": 6})
  assert report["accepted_vs_sft"] == report["rounds"][0]["change"]
  md = markdown(report)
  assert f"| sft | +0.050 ± {se:.3f} | pass |" in md
  assert f"`round_000000` minus the SFT policy: +0.050 ± {se:.3f} (paired over 6 cells)" in md
  summary = run_summary(report, "/tmp/run").splitlines()
  assert summary[2].endswith(f"; minus SFT +0.050 ± {se:.3f} (paired per cell)")
  # Without per-cell scores (an external evaluator's report) there is no change to show.
  del state.evaluations["sft"]["cell_overall"]
  assert build_report(state)["rounds"][0]["change"] is None


def test_the_heldback_change_is_paired_on_its_own_cells_and_shown_when_scored():
  """Held-back cells: the accepted policy minus SFT on cells no gate saw, paired per cell; no
  line (and None) when they were not scored."""
  before = [_cell(t, s, 0.5) for t, s in _CELLS]
  state = _one_round(before, [_cell(t, s, 0.8) for t, s in _CELLS], passed=True)
  assert build_report(state)["accepted_vs_sft_heldback"] is None
  assert "held-back" not in markdown(build_report(state))
  lost = [_cell(t, s, 0.2 if (t, s) == _CELLS[1] else 0.5) for t, s in _CELLS]
  for name, records in (("heldback_sft", before), ("heldback_round_000000", lost)):
    state.evaluations[name] = headline(aggregation.aggregate(
        records, tier="lite", protocol_digest="a" * 64, cell_set_digest="c" * 64))
  report = build_report(state)
  se = standard_error([-0.3, 0, 0, 0, 0, 0])
  assert report["accepted_vs_sft_heldback"] == pytest.approx({"mean": -0.05, "se": se,
                                                              "cells": 6})
  assert report["accepted_vs_sft"]["mean"] == pytest.approx(0.3)  # the gate's cells
  assert [e["policy"] for e in report["heldback_evaluations"]] == ["sft", "round_000000"]
  assert [e["policy"] for e in report["evaluations"]] == ["sft", "round_000000"]
  assert (f"On 6 held-back cells (no gate decision or target saw them): -0.050 ± {se:.3f}; "
          "`sft` 0.500, `round_000000` 0.450.") in markdown(report)
  assert run_summary(report, "/tmp/run").splitlines()[2].endswith(
      f"; on the held-back cells -0.050 ± {se:.3f}")


def test_each_round_shows_every_stage_change_with_its_paired_error():
  """A round's per-stage changes (and its target's) are means of per-cell changes with the
  paired SE: one cell of six losing S3 is -1/6 ± 1/6, not a bare -0.167 to hold a round on."""
  same = {s: 1.0 for s in workflow.STAGES}
  before = [_cell(t, s, 0.5, same) for t, s in _CELLS]
  after = [_cell(t, s, 0.5, dict(same, S3=0.0) if (t, s) == _CELLS[1] else
                 dict(same, S4=0.5) if (t, s) in _CELLS[3:5] else same) for t, s in _CELLS]
  state = _one_round(before, after, passed=False)
  report = build_report(state)
  changes = report["rounds"][0]["stage_changes"]
  se3, se4 = standard_error([-1.0, 0, 0, 0, 0, 0]), standard_error([-0.5, -0.5, 0, 0, 0, 0])
  assert changes["S3"] == pytest.approx({"mean": -1 / 6, "se": se3, "cells": 6})
  assert changes["S4"] == pytest.approx({"mean": -1 / 6, "se": se4, "cells": 6})
  assert changes["S1"] == {"mean": 0.0, "se": 0.0, "cells": 6}
  assert report["target_before_after"][0]["change"] == changes["S3"]
  md = markdown(report)
  assert f"| 0 | S3 | 1.000 | 0.833 | -0.167 ± {se3:.3f} |" in md
  assert (f"| 0 | +0.000 ± 0.000 | +0.000 ± 0.000 | -0.167 ± {se3:.3f} | -0.167 ± {se4:.3f} | "
          "+0.000 ± 0.000 |") in md
  # An evaluation without per-cell stage scores (an older evaluator's): no change, no table.
  del state.evaluations["sft"]["cell_stage_scores"]
  older = build_report(state)
  assert older["target_before_after"][0]["change"] is None
  assert "Every stage's change" not in markdown(older)


def test_the_base_line_names_the_deep_probe_and_the_extension_only_when_the_record_has_them():
  from bat_jax.bicurl.report import _base_line  # pylint: disable=protected-access
  record = {"key": "k", "cache_hit": True, "copy_accuracy": 0.708, "probes": 96,
            "value_accuracy": 0.93, "echo_steps": 100, "echo_long_steps": 150, "steps": 700,
            "seconds": 651.0}
  old = _base_line(record)   # a record from before the deep probe and the extension
  assert "250 echo + 700 corpus steps, 651 s" in old and "after" not in old
  new = _base_line({**record, "deep_copy_accuracy": 0.729, "probe_depth": 768,
                    "extend_steps": 150, "extend_seq_len": 1024})
  assert "0.729 after 768 tokens of other documents" in new
  assert "700 corpus steps + 150 at 1024 tokens, 651 s" in new
  assert new.endswith("651 s to build.")   # a record from before the builder was recorded
  host = {"machine": "x86_64", "cpu": "AMD EPYC", "isa": ["avx2", "fma"], "cores": 2,
          "jax": "0.8.1", "jaxlib": "0.8.1", "xla_flags": ""}
  named = _base_line({**record, "host": host})
  assert named.endswith("651 s to build on AMD EPYC (avx2, fma; jaxlib 0.8.1).")
