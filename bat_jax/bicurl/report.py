"""The run report: WORKDIR/report.json, report.md and PNG plots (matplotlib, Agg).

Everything here is a pure function of the outer-loop state (`OuterState`), so the report can be
rebuilt from a run directory at any time (`write_report(workdir, state)`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from bat_jax import workflow  # noqa: E402
from bat_jax.bicurl.state import OuterState, heldback_name  # noqa: E402
from bat_jax.io_utils import atomic_write_json, atomic_write_text  # noqa: E402
from bat_jax.stats import paired_change, standard_error  # noqa: E402,F401  (re-exported)

PLOTS = ("stage_scores.png", "rewards_kl.png")
KL_NOTE = ("no GRPO update applied in {steps} step(s)\n(tied rewards in every group:\n"
           "no_signal), so no KL to show")


def stage_reach(report: dict[str, Any]) -> Optional[dict[str, Any]]:
  """Each stage's score split into how often an episode reached it and how well it did there:
  `evidence[S]` cells of `cells` hold evidence of S, and `where_reached[S]` is the stage's
  mean over those cells. Exact, from the aggregate alone: a stage without evidence scores 0
  in an end-to-end cell, so the sum over the reached cells is the mean times all cells.

  Why: the reported S5 is 0 in every cell that never reached `submit`, so a downstream stage
  can be the weakest as reported and strong where it is reached (run m1's SFT policy: S5
  0.250 as reported, 0.750 over the 14 of 42 cells that reached it; experiments/README.md,
  "GRPO's step"). None for a report without completion counts or with invalid cells.
  """
  completion = report.get("completion")
  if not completion or completion["valid"] != completion["cells"] or not completion["cells"]:
    return None
  cells, evidence = completion["cells"], completion["stage_evidence"]
  score = report["stage_scores"]
  return {"cells": cells, "evidence": dict(evidence),
          "where_reached": {s: (min(1.0, score[s] * cells / evidence[s])
                                if evidence[s] and score[s] is not None else None)
                            for s in workflow.STAGES}}


def headline(report: dict[str, Any]) -> dict[str, Any]:
  """The evaluation numbers the report shows (aggregate scores only).

  `standard_errors` are over the per-track means of the aggregate report, i.e. the track is
  the unit of replication; `cell_overall` and `cell_stage_scores` (per track, when the
  evaluator exports them) keep the per-cell scores for the paired round changes
  (`build_report`).
  """
  tracks = [t for t in report.get("track_scores", {}).values() if t["overall"] is not None]
  per_cell = lambda key: {t: v[key] for t, v in report.get("track_scores", {}).items()
                          if isinstance(v, dict) and key in v} or None
  return {"stage_reach": stage_reach(report), "cell_overall": per_cell("cell_overall"),
          "cell_stage_scores": per_cell("cell_stage_scores"),
          "overall": report["overall"], "task": report["task_score"],
          "agentic": report["agentic"], "stage_scores": dict(report["stage_scores"]),
          "failure_categories": dict(report.get("failure_categories", {})),
          "standard_errors": {
              "unit": "track", "n": len(tracks),
              "overall": standard_error([t["overall"] for t in tracks]),
              "stage_scores": {s: standard_error([t["stage_scores"][s] for t in tracks
                                                  if t["stage_scores"][s] is not None])
                               for s in workflow.STAGES}}}


def build_report(state: OuterState) -> dict[str, Any]:
  """The JSON report: evaluations in order (sft, round_000000, ...), rounds, phase times."""
  names = ["sft"] + [r.candidate for r in state.rounds]
  evaluations = [{"policy": n, **state.evaluations[n]} for n in names if n in state.evaluations]
  steps = [s for r in state.rounds for s in r.steps]
  stage_changes = [{s: _change(state, r.start_policy, r.candidate, s) for s in workflow.STAGES}
                   for r in state.rounds]
  return {
      "evaluations": evaluations,
      "target_before_after": [_target_scores(state, r, changes[r.target])
                              for r, changes in zip(state.rounds, stage_changes)],
      "grpo_steps_applied": sum(1 for s in steps if not s.get("no_signal")),
      "grpo_steps_total": len(steps),
      "sft_validation_nll": state.sft_validation_nll,
      "pretrain": state.pretrain,
      "first_target": (state.rounds[0].target if state.rounds else None),
      "rounds": [{k: v for k, v in dataclasses.asdict(r).items() if k != "steps"}
                 | {"grpo_steps": len(r.steps),
                    "reward_mean": _mean([s["reward_mean"] for s in r.steps]),
                    "kl_mean": _mean([s["kl"] for s in r.steps if "kl" in s]),
                    "reward_by_pool": _pool_rewards(r.steps),
                    "change": _change(state, r.start_policy, r.candidate),
                    "stage_changes": changes}
                 for r, changes in zip(state.rounds, stage_changes)],
      "accepted_vs_sft": _change(state, "sft", state.baseline),
      # None unless held-back cells were scored (`evaluator.heldback_cells_per_track`, and a
      # round was promoted): the same change on cells no gate decision saw.
      "accepted_vs_sft_heldback": _change(state, heldback_name("sft"),
                                          heldback_name(state.baseline or "sft")),
      "heldback_evaluations": [{"policy": n, **state.evaluations[heldback_name(n)]}
                               for n in dict.fromkeys(("sft", state.baseline))
                               if heldback_name(n) in state.evaluations],
      "steps": [{"round": r.round, **s} for r in state.rounds for s in r.steps],
      "baseline": state.baseline,
      "phase_seconds": {k: round(v, 2) for k, v in state.phase_seconds.items()},
      "finished_rounds": len(state.rounds),
  }


def _change(state: OuterState, before: str, after: str,
            stage: Optional[str] = None) -> Optional[dict[str, Any]]:
  """Held-out overall (or `stage`'s score) of `after` minus `before`, per cell, with its paired
  standard error; None where an evaluation lacks per-cell scores (an older evaluator's)."""
  def cells(policy: str) -> Optional[dict[str, list[float]]]:
    e = state.evaluations.get(policy, {})
    if stage is None:
      return e.get("cell_overall")
    per_track = e.get("cell_stage_scores")
    return None if per_track is None else {t: v[stage] for t, v in per_track.items()}
  what = "cell_overall" if stage is None else f"cell_stage_scores.{stage}"
  return paired_change(cells(before), cells(after), what)


def _target_scores(state: OuterState, r: Any,
                   change: Optional[dict[str, Any]]) -> dict[str, Any]:
  """Held-out score of the round's target stage on its start policy and on its candidate, and
  `change`, its paired per-cell change (the round's `stage_changes` entry)."""
  def score(policy: str) -> Optional[float]:
    e = state.evaluations.get(policy)
    return None if e is None or r.target not in e["stage_scores"] else e["stage_scores"][r.target]
  return {"round": r.round, "target": r.target, "start_policy": r.start_policy,
          "before": score(r.start_policy), "after": score(r.candidate),
          "change": change}


def _pool_rewards(steps: list[dict]) -> dict[str, dict[str, Optional[float]]]:
  """Per pool, its mean training reward over the first and the last third of a round's steps:
  whether the round learnt its own practice, apart from whether that reached held-out cells."""
  third = max(1, len(steps) // 3)
  return {pool: {part: _mean([s[f"reward_{pool}"] for s in chunk if f"reward_{pool}" in s])
                 for part, chunk in (("first", steps[:third]), ("last", steps[-third:]))}
          for pool in workflow.POOLS}


def _pool_text(round_report: dict, pool: str) -> str:
  part = round_report.get("reward_by_pool", {}).get(pool, {})
  return f"{_fmt(part.get('first'))} → {_fmt(part.get('last'))}"


def _mean(values: list[float]) -> Optional[float]:
  return sum(values) / len(values) if values else None


def _fmt(x: Optional[float]) -> str:
  return "null" if x is None else f"{x:.3f}"


def _pm(x: Optional[float], se: Optional[float]) -> str:
  return _fmt(x) if se is None or x is None else f"{x:.3f} ± {se:.3f}"


def _change_text(change: Optional[dict[str, Any]]) -> str:
  if not change:
    return "-"
  se = change["se"]
  return f"{change['mean']:+.3f}" + ("" if se is None else f" ± {se:.3f}")


def _reach_table(evaluations: list[dict[str, Any]]) -> list[str]:
  """Per stage: its mean over the cells that reached it, and how many did (`stage_reach`)."""
  rows = [(e["policy"], e["stage_reach"]) for e in evaluations if e.get("stage_reach")]
  if not rows:
    return []
  lines = ["", "Where each stage was reached (cells holding its evidence): the stage's mean "
           "over those cells (cells / all). A stage without evidence scores 0 above, so "
           "upstream failures lower every later stage there.", "",
           "| policy | " + " | ".join(workflow.STAGES) + " |",
           "|---|" + "---:|" * len(workflow.STAGES)]
  for policy, reach in rows:
    lines.append(f"| {policy} | " + " | ".join(
        f"{_fmt(reach['where_reached'][s])} ({reach['evidence'][s]}/{reach['cells']})"
        for s in workflow.STAGES) + " |")
  return lines


def _target_table(report: dict[str, Any]) -> list[str]:
  lines = ["", "## Target stage before / after its round", "",
           "Change: after minus before, mean over the cells ± paired standard error (a stage "
           "score moves by 1/n of one cell's change).", "",
           "| round | target | before | after | change |", "|---:|---|---:|---:|---:|"]
  return lines + [f"| {t['round']} | {t['target']} | {_fmt(t['before'])} | {_fmt(t['after'])} | "
                  f"{_change_text(t.get('change'))} |"
                  for t in report.get("target_before_after", [])]


def _stage_change_table(report: dict[str, Any]) -> list[str]:
  """Every stage's change over each round (candidate minus start policy, paired per cell): a
  hold for a stage drop can be read against its noise."""
  rounds = [r for r in report["rounds"] if any((r.get("stage_changes") or {}).values())]
  if not rounds:
    return []
  lines = ["", "Every stage's change over each round (candidate minus start, ± paired SE):", "",
           "| round | " + " | ".join(workflow.STAGES) + " |",
           "|---:|" + "---:|" * len(workflow.STAGES)]
  return lines + [f"| {r['round']} | " + " | ".join(_change_text(r["stage_changes"].get(s))
                                                    for s in workflow.STAGES) + " |"
                  for r in rounds]


def _base_line(base: dict[str, Any]) -> str:
  """The tiny base's record in one sentence: its probes, phases and build time."""
  deep = (f", {base['deep_copy_accuracy']:.3f} after {base['probe_depth']} tokens of other "
          "documents" if "deep_copy_accuracy" in base else "")
  extend = (f" + {base['extend_steps']} at {base['extend_seq_len']} tokens"
            if base.get("extend_steps") else "")
  echo_steps = base.get("echo_steps", 0) + base.get("echo_long_steps", 0)
  host = base.get("host")   # bases cached before the record named its builder have none
  built_on = (f" on {host['cpu'] or host['machine']} ({', '.join(host['isa']) or 'no ISA flags'}"
              f"; jaxlib {host['jaxlib']})" if host else "")
  return (f"Tiny base `{base['key']}` ({'cached' if base['cache_hit'] else 'built'}): "
          f"copy accuracy {base['copy_accuracy']:.3f} on {base['probes']} fresh probes "
          f"(values {base['value_accuracy']:.3f}){deep}, {echo_steps} echo + {base['steps']} "
          f"corpus steps{extend}, {base['seconds']:.0f} s to build{built_on}.")


def markdown(report: dict[str, Any]) -> str:
  """Tables: held-out scores per evaluated policy (± standard error over tracks), rounds
  (target, gate, target stage before/after), phase wall times."""
  lines = ["# BiCuRL run report", "", "## Held-out scores (per stage, over rounds)", "",
           "Mean over the held-out cells ± standard error over the per-track means.", "",
           "| policy | overall | task | agentic | " + " | ".join(workflow.STAGES) + " |",
           "|---|---:|---:|---:|" + "---:|" * len(workflow.STAGES)]
  for e in report["evaluations"]:
    se = e.get("standard_errors") or {"overall": None, "stage_scores": {}}
    lines.append(f"| {e['policy']} | {_pm(e['overall'], se['overall'])} | {_fmt(e['task'])} | "
                 f"{_fmt(e['agentic'])} | "
                 + " | ".join(_pm(e["stage_scores"][s], se["stage_scores"].get(s))
                              for s in workflow.STAGES) + " |")
  lines += _reach_table(report["evaluations"])
  lines += _target_table(report) + _stage_change_table(report)
  lines += ["", f"GRPO steps that applied an update: {report.get('grpo_steps_applied', 0)} of "
            f"{report.get('grpo_steps_total', 0)} (the others had tied rewards in every group: "
            "`no_signal`)."]
  lines += ["", "## Rounds", "",
            "Change: the candidate's held-out overall minus its start policy's, mean over the "
            "cells ± paired standard error.", "",
            "| round | target | stage weights | pool mix | start | change | gate | promoted | "
            "healthy | reward | S-target reward, first → last third | KL | held because |",
            "|---:|---|---|---|---|---:|---|---|---|---:|---|---:|---|"]
  for r in report["rounds"]:
    reasons = "; ".join(r["gate"]["reasons"]) or "-"
    stage_w = " ".join(f"{s}:{r['weights']['stage_weights'][s]:.2f}" for s in workflow.STAGES
                       if r["weights"]["stage_weights"][s])
    pool_w = " ".join(f"{p}:{r['weights']['pool_mix'][p]:.2f}" for p in workflow.POOLS)
    lines.append(f"| {r['round']} | {r['target']} | {stage_w} | {pool_w} | {r['start_policy']} | "
                 f"{_change_text(r.get('change'))} | "
                 f"{'pass' if r['gate']['passed'] else 'hold'} | {r['promoted']} | "
                 f"{r['healthy']} | {_fmt(r['reward_mean'])} | {_pool_text(r, 's_target')} | "
                 f"{_fmt(r['kl_mean'])} | "
                 f"{reasons} |")
  accepted = report.get("accepted_vs_sft")
  if accepted:
    lines += ["", f"Accepted policy `{report['baseline']}` minus the SFT policy: "
              f"{_change_text(accepted)} (paired over {accepted['cells']} cells)."]
  heldback = report.get("accepted_vs_sft_heldback")
  if heldback:
    lines += ["", f"On {heldback['cells']} held-back cells (no gate decision or target saw "
              f"them): {_change_text(heldback)}; " + ", ".join(
                  f"`{e['policy']}` {_fmt(e['overall'])}"
                  for e in report["heldback_evaluations"]) + "."]
  lines += ["", "## Wall time per phase (s)", "", "| phase | seconds |", "|---|---:|"]
  lines += [f"| {k} | {v:.1f} |" for k, v in report["phase_seconds"].items()]
  base = report.get("pretrain")
  if base:
    lines += ["", _base_line(base)]
  lines += ["", f"Cold-start SFT validation NLL per target token: "
            f"{_fmt(report['sft_validation_nll'])}.", f"Promoted policy: `{report['baseline']}`.",
            ""]
  return "\n".join(lines)


def plot(report: dict[str, Any], out_dir: Path) -> list[Path]:
  """Stage scores per evaluation (targets and gate decisions marked), rewards and KL per step."""
  out_dir = Path(out_dir)
  evals = report["evaluations"]
  fig, ax = plt.subplots(figsize=(8, 4.5))
  xs = list(range(len(evals)))
  for stage in workflow.STAGES:
    ys = [e["stage_scores"][stage] for e in evals]
    ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=stage)
  ax.plot(xs, [e["overall"] for e in evals], "k--", marker="s", label="overall")
  for r in report["rounds"]:
    x = r["round"] + 1
    ax.annotate(f"{r['target']}\n{'pass' if r['gate']['passed'] else 'hold'}", (x, 1.02),
                ha="center", va="bottom", fontsize=7, xycoords=("data", "axes fraction"),
                color="green" if r["gate"]["passed"] else "red")
  ax.set_xticks(xs, [e["policy"] for e in evals], rotation=30, fontsize=7)
  ax.set_ylabel("held-out score")
  ax.set_ylim(-0.02, 1.02)
  ax.legend(fontsize=7, ncol=4)
  fig.tight_layout()
  stage_png = out_dir / PLOTS[0]
  fig.savefig(stage_png, dpi=100)
  plt.close(fig)

  fig = rewards_kl_figure(report["steps"])
  rewards_png = out_dir / PLOTS[1]
  fig.savefig(rewards_png, dpi=100)
  plt.close(fig)
  return [stage_png, rewards_png]


def rewards_kl_figure(steps: list[dict[str, Any]]) -> Any:
  """Mean reward and KL per GRPO step; a note where nothing was applied (no empty axes)."""
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
  xs = list(range(1, len(steps) + 1))
  a1.plot(xs, [s["reward_mean"] for s in steps], marker=".")
  a1.set_title("mean rollout reward per GRPO step", fontsize=9)
  kl = [s.get("kl", float("nan")) for s in steps]
  a2.plot(xs, kl, marker=".", color="C3")
  a2.set_title("KL to the SFT policy per GRPO step", fontsize=9)
  # Steps whose groups all tied (no_signal) or whose update was skipped change nothing.
  applied = [k for s, k in zip(steps, kl) if not s.get("no_signal")
             and s.get("update_applied", 1.0) != 0.0 and math.isfinite(k)]
  if not applied:
    a2.text(0.5, 0.5, KL_NOTE.format(steps=len(steps)), ha="center", va="center",
            transform=a2.transAxes, fontsize=8, wrap=True)
    a2.set_yticks([])
    if steps:
      a2.set_xlim(0.5, len(steps) + 0.5)
  if not steps:
    a1.text(0.5, 0.5, "no GRPO steps yet", ha="center", va="center", transform=a1.transAxes,
            fontsize=8)
  for a in (a1, a2):
    a.set_xlabel("GRPO step (all rounds)")
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
  fig.tight_layout()
  return fig


def write_report(workdir: Path, state: OuterState) -> dict[str, Any]:
  """Writes report.json, report.md and the plots (atomic JSON; plots overwritten)."""
  workdir = Path(workdir)
  report = build_report(state)
  atomic_write_json(workdir / "report.json", report)
  atomic_write_text(workdir / "report.md", markdown(report))
  plot(report, workdir)
  return report


def run_summary(report: dict[str, Any], workdir: str | Path) -> str:
  """What a finished run prints: its held-out scores and where its artifacts are."""
  workdir = Path(workdir).absolute()
  evals = report["evaluations"]
  gates = ["pass" if r["gate"]["passed"] else "hold" for r in report["rounds"]]
  trail = " -> ".join(f"{e['policy']} {_fmt(e['overall'])}"
                      + (f" ({gates[i - 1]})" if 0 < i <= len(gates) else "")
                      for i, e in enumerate(evals))
  promoted = next((e for e in evals if e["policy"] == report["baseline"]), None)
  stages = "" if promoted is None else " ".join(
      f"{s} {_fmt(promoted['stage_scores'][s])}" for s in workflow.STAGES)
  policies = workdir / "policies"
  kept = sorted(p.name for p in policies.iterdir()) if policies.is_dir() else []
  return "\n".join([
      f"BiCuRL finished {report['finished_rounds']} round(s): "
      f"{report['grpo_steps_applied']} of {report['grpo_steps_total']} GRPO steps applied; "
      f"promoted policy {report['baseline']}",
      f"held-out overall: {trail}",
      f"{report['baseline']} per stage: {stages}"
      + ("" if not report.get("accepted_vs_sft") else
         f"; minus SFT {_change_text(report['accepted_vs_sft'])} (paired per cell)")
      + ("" if not report.get("accepted_vs_sft_heldback") else
         f"; on the held-back cells {_change_text(report['accepted_vs_sft_heldback'])}"),
      f"report:   {workdir / 'report.md'} (data: report.json)",
      "plots:    " + ", ".join(str(workdir / p) for p in PLOTS),
      f"policies: {policies}/{{{','.join(kept)}}}"])
