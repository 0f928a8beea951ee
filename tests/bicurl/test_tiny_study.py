"""experiments/tiny_study.py: the shared cold start fork and the mean ± SE table (no runs)."""

import json
import pathlib
import sys

import pytest

from bat_jax import workflow

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "experiments"))
import tiny_study  # noqa: E402


def _report(overall, target_scores, applied):
  evals = [{"policy": p, "overall": o, "stage_scores": {s: o for s in workflow.STAGES}}
           for p, o in zip(("sft", "round_000000"), overall)]
  return {"evaluations": evals, "rounds": [{"grpo_steps": 2, "reward_mean": 0.3}],
          "target_before_after": [{"round": 0, "target": "S3", "before": target_scores[0],
                                   "after": target_scores[1]}],
          "grpo_steps_applied": applied, "grpo_steps_total": 2, "baseline": "sft"}


def test_fork_copies_the_cold_start_and_resets_the_outer_state(tmp_path):
  src = tmp_path / "seed_0" / "argmin"
  for rel in ("tokenizer/tokenizer.json", "ckpt/sft/1/x", "policies/sft/model.safetensors",
              "evals/sft.json", "stagebank/sft/manifest.json", "stagebank/markers.json",
              "stagebank/round_000000/manifest.json", "evals/round_000000.json"):
    (src / rel).parent.mkdir(parents=True, exist_ok=True)
    (src / rel).write_text(rel)
  (src / "eval_secret").write_text("ab" * 32)
  (src / "eval_secret").chmod(0o600)
  (src / "config.json").write_text(json.dumps({"curriculum": {"mode": "argmin"}, "seed": 0}))
  (src / "outer_state.json").write_text(json.dumps({
      "sft_done": True, "sft_validation_nll": 0.5, "baseline": "round_000000",
      "next_weights": {"x": 1}, "rounds": [{"round": 0}],
      "evaluations": {"sft": {"overall": 0.2}, "round_000000": {"overall": 0.3}},
      "phase_seconds": {"sft": 10.0, "evaluation": 3.0}}))
  dst = tmp_path / "seed_0" / "uniform"
  tiny_study.fork_cold_start(src, dst, "uniform")
  assert json.loads((dst / "config.json").read_text()) == {"curriculum": {"mode": "uniform"},
                                                          "seed": 0}
  state = json.loads((dst / "outer_state.json").read_text())
  assert state["baseline"] == "sft" and state["rounds"] == [] and state["next_weights"] is None
  assert state["evaluations"] == {"sft": {"overall": 0.2}} and state["sft_validation_nll"] == 0.5
  assert (dst / "ckpt/sft/1/x").is_file() and (dst / "evals/sft.json").is_file()
  assert not (dst / "stagebank/round_000000").exists()  # rounds depend on the mode
  assert not (dst / "evals/round_000000.json").exists()
  # The run secret keys the held-out cells: a fork evaluates the cells of the copied SFT eval.
  assert (dst / "eval_secret").read_text() == "ab" * 32
  assert (dst / "eval_secret").stat().st_mode & 0o777 == 0o600


def test_fork_applies_dotted_overrides_and_refuses_an_unknown_field(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  (src / "config.json").write_text(json.dumps({"curriculum": {"mode": "argmin"},
                                               "grpo": {"advantage": {"mode": "grpo"}}}))
  (src / "outer_state.json").write_text(json.dumps({
      "sft_validation_nll": 0.5, "evaluations": {"sft": {}}, "phase_seconds": {}}))
  tiny_study.fork_cold_start(src, tmp_path / "placebo", "argmin",
                             {"grpo.advantage.mode": "placebo"})
  assert json.loads((tmp_path / "placebo" / "config.json").read_text())["grpo"] == \
      {"advantage": {"mode": "placebo"}}
  with pytest.raises(KeyError, match="grpo.advantage.typo"):
    tiny_study.fork_cold_start(src, tmp_path / "typo", "argmin", {"grpo.advantage.typo": 1})
  assert not list(tmp_path.glob("typo*"))   # refused before anything is copied


def test_table_has_mean_and_standard_error_over_seeds():
  reports = {"argmin": {0: _report([0.2, 0.4], [0.1, 0.5], 2),
                        1: _report([0.4, 0.6], [0.3, 0.5], 1)}}
  md = tiny_study.markdown(reports)
  assert "| argmin | 2 | sft | 0 | 0.300 ± 0.100 |" in md
  assert "| argmin | 2 | round_000000 | 2 | 0.500 ± 0.100 |" in md
  assert "| argmin | 0 | S3,S3 | 0.200 ± 0.100 | 0.500 ± 0.000 | 0.300 ± 0.100 |" in md
  assert "| argmin | 1 | 0.300 | 1 of 2 |" in md


def test_final_table_pairs_each_mode_with_uniform_by_seed():
  reports = {"argmin": {0: _report([0.2, 0.5], [0.1, 0.5], 2),
                        1: _report([0.4, 0.6], [0.3, 0.5], 2),
                        2: _report([0.1, 0.9], [0.3, 0.5], 2)},   # no uniform run: not paired
             "uniform": {0: _report([0.2, 0.3], [0.1, 0.2], 2),
                         1: _report([0.4, 0.6], [0.3, 0.3], 2)}}
  md = tiny_study.markdown(reports)
  assert "| argmin | 3 | 0.667 ± 0.120 | 0.433 ± 0.186 | 0.100 ± 0.100 |" in md
  assert "| uniform | 2 | 0.450 ± 0.150 | 0.150 ± 0.050 | - |" in md
  # Accepted: the gate promoted nothing in these reports, so every mode hands on its SFT policy.
  accepted = md[md.index("## Accepted policy's"):]
  assert "| argmin | 3 | 0.233 ± 0.088 | 0.000 ± 0.000 | 0.000 ± 0.000 |" in accepted


def test_accepted_table_follows_the_gate():
  held = _report([0.3, 0.6], [0.1, 0.5], 2)            # candidate 0.6, held: hands on SFT 0.3
  promoted = dict(_report([0.3, 0.4], [0.1, 0.5], 2), baseline="round_000000")
  md = tiny_study.markdown({"argmin": {0: promoted}, "uniform": {0: held}})
  final, accepted = md.split("## Accepted policy's")
  assert "| argmin | 1 | 0.400 | 0.100 | -0.200 |" in final   # last candidates: 0.4 vs 0.6
  assert "| argmin | 1 | 0.400 | 0.100 | 0.100 |" in accepted  # handed on: 0.4 vs SFT 0.3


def test_heldback_table_pairs_the_unselected_change_and_counts_a_held_run_as_zero():
  promoted = dict(_report([0.3, 0.4], [0.1, 0.5], 2), baseline="round_000000",
                  accepted_vs_sft_heldback={"mean": 0.06, "se": 0.03, "cells": 42})
  held = _report([0.3, 0.6], [0.1, 0.5], 2)                   # hands on SFT: 0 held back
  older = dict(_report([0.3, 0.4], [0.1, 0.5], 2), baseline="round_000000")  # no field
  md = tiny_study.markdown({"argmin": {0: promoted, 1: held, 2: older},
                            "uniform": {0: held, 1: promoted}})
  table = md[md.index("## Accepted policy minus SFT on the held-back cells"):]
  assert "| argmin | 2 | 0.030 ± 0.030 | 0.000 ± 0.060 |" in table   # seeds 0, 1 paired
  assert "| uniform | 2 | 0.030 ± 0.030 | - |" in table
  assert "held-back" not in tiny_study.markdown({"argmin": {0: older}})


def _round(mode):
  stage_w = ({s: float(s == "S3") for s in workflow.STAGES} if mode == "argmin"
             else {s: 0.2 for s in workflow.STAGES})
  pool = {"s_target": 0.0 if mode == "e2e_only" else 0.5, "s_mix": 0.25, "e2e": 0.25}
  return {"grpo_steps": 2, "reward_mean": 0.3, "target": "S3" if mode == "argmin" else "S1",
          "weights": {"stage_weights": stage_w, "pool_mix": pool}}


def test_modes_without_a_target_show_none():
  reports = {}
  for mode in ("argmin", "uniform", "e2e_only"):
    r = _report([0.2, 0.4], [0.1, 0.5], 2)
    r["rounds"] = [_round(mode)]
    r["target_before_after"][0]["target"] = r["rounds"][0]["target"]
    reports[mode] = {0: r}
  md = tiny_study.markdown(reports)
  rows = {m: [l for l in md.splitlines() if l.startswith(f"| {m} | 1 | round_000000 |")][0]
          for m in reports}
  assert rows["argmin"].endswith("| S3 |")
  assert rows["uniform"].endswith("| - |") and rows["e2e_only"].endswith("| - |")
  assert "| argmin | 0 | S3 |" in md  # the target table lists argmin's round ...
  assert "| uniform | 0 | S1 |" not in md and "| e2e_only | 0 | S1 |" not in md  # not theirs


def test_study_validates_every_run_before_starting(tmp_path, capsys):
  root = tmp_path / "study"
  code = tiny_study.main([f"--root={root}", "--modes=argmin,uniform", "--seeds=0,1", "--",
                          "--config.grpo.stepz=1"])
  assert code == 2
  err = capsys.readouterr().err
  assert "nothing started" in err and "argmin seed 0: --config.grpo.stepz=1: no config field" in err
  assert not root.exists()


def test_study_runs_evaluate_15_cells_per_track_unless_overridden(tmp_path):
  from bat_jax.config_loading import load_config
  runs = tiny_study.study_runs(tmp_path, ["argmin", "uniform"], [0, 3], [])
  assert [(r.label, r.seed) for r in runs] == [("argmin", 0), ("argmin", 3), ("uniform", 0),
                                               ("uniform", 3)]
  cfg = load_config(tiny_study.CONFIG, runs[1].overrides)
  assert cfg.evaluator.cells_per_track == 15 and cfg.seed == 3
  assert cfg.curriculum.mode == "argmin" and cfg.stagebank.seed == 3
  shared = tiny_study.study_runs(tmp_path, ["uniform"], [0],
                                 ["--config.evaluator.cells_per_track=4"])
  assert load_config(tiny_study.CONFIG, shared[0].overrides).evaluator.cells_per_track == 4
  assert tiny_study.SEEDS.split(",") == ["0", "1", "2", "3", "4"]
