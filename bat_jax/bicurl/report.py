"""The run report: WORKDIR/report.json, report.md and PNG plots (matplotlib, Agg).

Everything here is a pure function of the outer-loop state (`OuterState`), so the report can be
rebuilt from a run directory at any time (`write_report(workdir, state)`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from bat_jax import workflow  # noqa: E402
from bat_jax.bicurl.state import OuterState  # noqa: E402
from bat_jax.io_utils import atomic_write_json, atomic_write_text  # noqa: E402

PLOTS = ("stage_scores.png", "rewards_kl.png")


def headline(report: dict[str, Any]) -> dict[str, Any]:
  """The evaluation numbers the report shows (aggregate scores only)."""
  return {"overall": report["overall"], "task": report["task_score"],
          "agentic": report["agentic"], "stage_scores": dict(report["stage_scores"]),
          "failure_categories": dict(report.get("failure_categories", {}))}


def build_report(state: OuterState) -> dict[str, Any]:
  """The JSON report: evaluations in order (sft, round_000, ...), rounds, phase times."""
  names = ["sft"] + [r.candidate for r in state.rounds]
  evaluations = [{"policy": n, **state.evaluations[n]} for n in names if n in state.evaluations]
  return {
      "evaluations": evaluations,
      "sft_validation_nll": state.sft_validation_nll,
      "first_target": (state.rounds[0].target if state.rounds else None),
      "rounds": [{k: v for k, v in dataclasses.asdict(r).items() if k != "steps"}
                 | {"grpo_steps": len(r.steps),
                    "reward_mean": _mean([s["reward_mean"] for s in r.steps]),
                    "kl_mean": _mean([s["kl"] for s in r.steps if "kl" in s])}
                 for r in state.rounds],
      "steps": [{"round": r.round, **s} for r in state.rounds for s in r.steps],
      "baseline": state.baseline,
      "phase_seconds": {k: round(v, 2) for k, v in state.phase_seconds.items()},
      "finished_rounds": len(state.rounds),
  }


def _mean(values: list[float]) -> Optional[float]:
  return sum(values) / len(values) if values else None


def _fmt(x: Optional[float]) -> str:
  return "null" if x is None else f"{x:.3f}"


def markdown(report: dict[str, Any]) -> str:
  """Tables: held-out scores per evaluated policy, rounds (target, gate), phase wall times."""
  lines = ["# BiCuRL run report", "", "## Held-out scores", "",
           "| policy | overall | task | agentic | " + " | ".join(workflow.STAGES) + " |",
           "|---|---:|---:|---:|" + "---:|" * len(workflow.STAGES)]
  for e in report["evaluations"]:
    lines.append(f"| {e['policy']} | {_fmt(e['overall'])} | {_fmt(e['task'])} | "
                 f"{_fmt(e['agentic'])} | "
                 + " | ".join(_fmt(e["stage_scores"][s]) for s in workflow.STAGES) + " |")
  lines += ["", "## Rounds", "",
            "| round | target | stage weights | pool mix | start | gate | promoted | healthy | "
            "reward | KL | held because |",
            "|---:|---|---|---|---|---|---|---|---:|---:|---|"]
  for r in report["rounds"]:
    reasons = "; ".join(r["gate"]["reasons"]) or "-"
    stage_w = " ".join(f"{s}:{r['weights']['stage_weights'][s]:.2f}" for s in workflow.STAGES
                       if r["weights"]["stage_weights"][s])
    pool_w = " ".join(f"{p}:{r['weights']['pool_mix'][p]:.2f}" for p in workflow.POOLS)
    lines.append(f"| {r['round']} | {r['target']} | {stage_w} | {pool_w} | {r['start_policy']} | "
                 f"{'pass' if r['gate']['passed'] else 'hold'} | {r['promoted']} | "
                 f"{r['healthy']} | {_fmt(r['reward_mean'])} | {_fmt(r['kl_mean'])} | "
                 f"{reasons} |")
  lines += ["", "## Wall time per phase (s)", "", "| phase | seconds |", "|---|---:|"]
  lines += [f"| {k} | {v:.1f} |" for k, v in report["phase_seconds"].items()]
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

  steps = report["steps"]
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
  xs = list(range(1, len(steps) + 1))
  a1.plot(xs, [s["reward_mean"] for s in steps], marker=".")
  a1.set_title("mean rollout reward per GRPO step", fontsize=9)
  a2.plot(xs, [s.get("kl", float("nan")) for s in steps], marker=".", color="C3")
  a2.set_title("KL to the SFT policy per GRPO step", fontsize=9)
  for a in (a1, a2):
    a.set_xlabel("GRPO step (all rounds)")
  fig.tight_layout()
  rewards_png = out_dir / PLOTS[1]
  fig.savefig(rewards_png, dpi=100)
  plt.close(fig)
  return [stage_png, rewards_png]


def write_report(workdir: Path, state: OuterState) -> dict[str, Any]:
  """Writes report.json, report.md and the plots (atomic JSON; plots overwritten)."""
  workdir = Path(workdir)
  report = build_report(state)
  atomic_write_json(workdir / "report.json", report)
  atomic_write_text(workdir / "report.md", markdown(report))
  plot(report, workdir)
  return report
