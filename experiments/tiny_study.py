r"""The tiny study: argmin (BaT) vs softmin, uniform and e2e_only at equal GRPO steps, over seeds.

Every run is `configs/tiny.py` with `--config.seed=S --config.stagebank.seed=S` and
`--config.curriculum.mode=M` (the held-out cells stay fixed by `evaluator.seed`). The modes of
one seed share its cold start: the first mode to run does tokenizer, SFT rows, SFT and the SFT
evaluation; the others start from a copy of exactly those files (`fork_cold_start`), so they
differ only in what the curriculum does afterwards. Everything is resumable: rerun the same
command (or another `--modes` / `--seeds` slice) on the same root; finished runs are skipped,
killed ones resume.

  python experiments/tiny_study.py --root=runs/tiny_study                       # everything
  python experiments/tiny_study.py --root=runs/tiny_study --modes=argmin,uniform --seeds=0
  python experiments/tiny_study.py --root=runs/tiny_study --collect_only

Results: ROOT/study.md (mean ± standard error over seeds of held-out overall and of each stage,
after SFT and after each round, plus each round's target stage before / after its round),
ROOT/study.json and ROOT/study.png (per-stage held-out scores across rounds, one panel per mode).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # noqa: E402

from bat_jax import workflow  # noqa: E402
from bat_jax.bicurl.report import standard_error  # noqa: E402
from bat_jax.io_utils import atomic_write_json, atomic_write_text  # noqa: E402

MODES = ("argmin", "softmin", "uniform", "e2e_only")
CONFIG = "configs/tiny.py"
# What a forked run copies from its seed's first run: everything the cold start produced.
COLD_START_PATHS = ("tokenizer", "stagebank/sft", "stagebank/markers.json", "ckpt/sft",
                    "policies/sft", "evals/sft.json", "xla_cache")


def run_dir(root: Path, seed: int, mode: str) -> Path:
  return root / f"seed_{seed}" / mode


def _cold_done(workdir: Path) -> bool:
  state = workdir / "outer_state.json"
  return (workdir / "evals" / "sft.json").is_file() and state.is_file() \
      and json.loads(state.read_text()).get("sft_done", False)


def fork_cold_start(source: Path, target: Path, mode: str) -> None:
  """Starts `target` from `source`'s cold start: its files, its config with `mode`, and an outer
  state holding only the SFT phase (so the curriculum picks its first target itself)."""
  if target.exists():
    return
  tmp = target.with_name(target.name + ".forking")
  shutil.rmtree(tmp, ignore_errors=True)
  for rel in COLD_START_PATHS:
    src = source / rel
    if src.is_dir():
      shutil.copytree(src, tmp / rel)
    elif src.is_file():
      (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, tmp / rel)
  config = json.loads((source / "config.json").read_text())
  config["curriculum"]["mode"] = mode
  atomic_write_json(tmp / "config.json", config)
  state = json.loads((source / "outer_state.json").read_text())
  atomic_write_json(tmp / "outer_state.json", {
      "sft_done": True, "sft_validation_nll": state["sft_validation_nll"], "baseline": "sft",
      "next_weights": None, "rounds": [], "evaluations": {"sft": state["evaluations"]["sft"]},
      "phase_seconds": {k: 0.0 for k in state["phase_seconds"]}})
  tmp.rename(target)


def _launch(root: Path, seed: int, mode: str, extra: Sequence[str]):
  overrides = {"seed": seed, "stagebank.seed": seed, "curriculum.mode": mode,
               "logging.progress": False}
  return sweep.launch_variant(CONFIG, run_dir(root, seed, mode), overrides, extra)


def _finished(workdir: Path) -> bool:
  """Whether a run has done every round its config asks for."""
  report, config = workdir / "report.json", workdir / "config.json"
  return report.is_file() and config.is_file() and \
      json.loads(report.read_text())["finished_rounds"] >= \
      json.loads(config.read_text())["grpo"]["rounds"]


def run_seed(root: Path, seed: int, modes: Sequence[str], extra: Sequence[str],
             parallel: int) -> None:
  """Runs (or resumes) every mode of one seed; the first one does the shared cold start."""
  dirs = {m: run_dir(root, seed, m) for m in modes}
  source = next((d for d in (run_dir(root, seed, m) for m in MODES) if _cold_done(d)), None)
  pending = list(modes)
  if source is None:
    first = pending.pop(0)
    print(f"seed {seed}: {first} runs the shared cold start", file=sys.stderr)
    if _launch(root, seed, first, extra).wait() != 0:
      print(f"seed {seed} {first} failed; see {dirs[first]}.log", file=sys.stderr)
      return
    source = dirs[first]
  for m in pending:
    if m != source.name:
      fork_cold_start(source, dirs[m], m)
  pending = [m for m in pending if not _finished(dirs[m])]
  running: list[tuple[str, Any]] = []
  while pending or running:
    while pending and len(running) < parallel:
      m = pending.pop(0)
      running.append((m, _launch(root, seed, m, extra)))
    m, proc = running.pop(0)
    if proc.wait() != 0:
      print(f"seed {seed} {m} failed (exit {proc.returncode}); see {dirs[m]}.log",
            file=sys.stderr)


# --- the table and the plot --------------------------------------------------------------------

def _pm(values: list[float]) -> str:
  if not values:
    return "-"
  mean = sum(values) / len(values)
  se = standard_error(values)
  return f"{mean:.3f}" + ("" if se is None else f" ± {se:.3f}")


def collect(root: Path, modes: Sequence[str], seeds: Sequence[int]) -> dict[str, Any]:
  """mode -> {seed: report.json} for every finished run under root."""
  out: dict[str, Any] = {}
  for m in modes:
    for s in seeds:
      path = run_dir(root, s, m) / "report.json"
      if path.is_file():
        out.setdefault(m, {})[s] = json.loads(path.read_text())
  return out


def _final_overall(report: dict[str, Any]) -> float:
  return report["evaluations"][-1]["overall"]


def final_table(reports: dict[str, Any], reference: str = "uniform") -> list[str]:
  """Final held-out overall per mode, its gain over the mode's own SFT policy, and the paired
  difference to `reference` over the seeds both finished (same cold start, so the pairing
  removes the seed's SFT luck from the comparison)."""
  lines = ["## Final held-out overall per mode", "",
           f"| mode | seeds | final overall | final - SFT | final - {reference} (paired) |",
           "|---|---:|---:|---:|---:|"]
  base = reports.get(reference, {})
  for mode, by_seed in reports.items():
    finals = [_final_overall(r) for r in by_seed.values()]
    gains = [_final_overall(r) - r["evaluations"][0]["overall"] for r in by_seed.values()]
    paired = [_final_overall(r) - _final_overall(base[s]) for s, r in by_seed.items()
              if s in base]
    lines.append(f"| {mode} | {len(finals)} | {_pm(finals)} | {_pm(gains)} | "
                 f"{_pm(paired) if mode != reference else '-'} |")
  return lines + [""]


def markdown(reports: dict[str, Any]) -> str:
  keys = ["overall", *workflow.STAGES]
  lines = ["# Tiny study: held-out scores, mean ± standard error over seeds", "",
           "| mode | seeds | policy | GRPO steps | " + " | ".join(keys) + " |",
           "|---|---:|---|---:|" + "---:|" * len(keys)]
  for mode, by_seed in reports.items():
    n_evals = min(len(r["evaluations"]) for r in by_seed.values())
    for i in range(n_evals):
      evals = [r["evaluations"][i] for r in by_seed.values()]
      steps = sorted({sum(x["grpo_steps"] for x in r["rounds"][:i]) for r in by_seed.values()})
      cells = [_pm([e["overall"] for e in evals])] + \
          [_pm([e["stage_scores"][s] for e in evals]) for s in workflow.STAGES]
      lines.append(f"| {mode} | {len(evals)} | {evals[0]['policy']} | "
                   f"{'/'.join(map(str, steps))} | " + " | ".join(cells) + " |")
  lines += [""] + final_table(reports)
  lines += ["## Each round's target stage, before and after its round", "",
            "| mode | round | targets (per seed) | before | after | after - before |",
            "|---|---:|---|---:|---:|---:|"]
  for mode, by_seed in reports.items():
    n_rounds = min(len(r.get("target_before_after", [])) for r in by_seed.values())
    for i in range(n_rounds):
      rows = [r["target_before_after"][i] for r in by_seed.values()]
      ok = [t for t in rows if t["before"] is not None and t["after"] is not None]
      lines.append(f"| {mode} | {i} | {','.join(t['target'] for t in rows)} | "
                   f"{_pm([t['before'] for t in ok])} | {_pm([t['after'] for t in ok])} | "
                   f"{_pm([t['after'] - t['before'] for t in ok])} |")
  lines += ["", "## Loop health", "", "| mode | seed | reward mean per round | "
            "GRPO steps applied |", "|---|---:|---|---:|"]
  for mode, by_seed in reports.items():
    for seed, r in sorted(by_seed.items()):
      rewards = ", ".join("null" if x["reward_mean"] is None else f"{x['reward_mean']:.3f}"
                          for x in r["rounds"])
      lines.append(f"| {mode} | {seed} | {rewards} | {r.get('grpo_steps_applied', '?')} of "
                   f"{r.get('grpo_steps_total', '?')} |")
  return "\n".join(lines + [""])


def plot(reports: dict[str, Any], path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  modes = list(reports)
  fig, axes = plt.subplots(1, max(1, len(modes)), figsize=(3.6 * max(1, len(modes)), 3.6),
                           sharey=True, squeeze=False)
  for ax, mode in zip(axes[0], modes):
    by_seed = reports[mode]
    n_evals = min(len(r["evaluations"]) for r in by_seed.values())
    xs = list(range(n_evals))
    for key in ["overall", *workflow.STAGES]:
      series = [[(e["overall"] if key == "overall" else e["stage_scores"][key])
                 for e in (r["evaluations"][i] for r in by_seed.values())] for i in xs]
      means = [sum(v) / len(v) for v in series]
      errs = [standard_error(v) or 0.0 for v in series]
      ax.errorbar(xs, means, yerr=errs, marker="o", capsize=2, label=key,
                  linestyle="--" if key == "overall" else "-", color="k" if key == "overall"
                  else None)
    ax.set_title(f"{mode} ({len(by_seed)} seed(s))", fontsize=9)
    ax.set_xticks(xs, ["sft"] + [f"r{i}" for i in range(n_evals - 1)], fontsize=8)
    ax.set_ylim(-0.02, 1.02)
  axes[0][0].set_ylabel("held-out score")
  axes[0][-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_study(root: Path, modes: Sequence[str], seeds: Sequence[int]) -> Optional[str]:
  reports = collect(root, modes, seeds)
  if not reports:
    return None
  text = markdown(reports)
  atomic_write_json(root / "study.json", {m: {str(s): r for s, r in v.items()}
                                           for m, v in reports.items()})
  atomic_write_text(root / "study.md", text)
  plot(reports, root / "study.png")
  return text


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  extra = argv[argv.index("--") + 1:] if "--" in argv else []
  own = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", type=Path, default=Path("runs/tiny_study"))
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--parallel", type=int, default=1, help="modes of a seed run at once")
  parser.add_argument("--collect_only", action="store_true")
  args = parser.parse_args(own)
  modes = [m for m in args.modes.split(",") if m]
  unknown = [m for m in modes if m not in MODES]
  if unknown:
    parser.error(f"--modes: unknown mode(s) {unknown}; expected some of {MODES}")
  seeds = [int(s) for s in args.seeds.split(",") if s]
  root = args.root.absolute()
  if not args.collect_only:
    for seed in seeds:
      run_seed(root, seed, modes, extra, args.parallel)
  text = write_study(root, modes, seeds)
  print(text or f"no finished runs under {root}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
