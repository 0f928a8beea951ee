r"""The tiny study: argmin (BaT) vs softmin, uniform, e2e_only and reach_argmin at equal GRPO
steps, over seeds.

A sweep (`experiments/sweep.py`'s machinery: every run's config validated before anything
starts, one progress line per run, resume, exit 1 if a run failed, mean ± standard error tables
and per-stage plots) over `curriculum.mode`, with one twist: the modes of one seed share its
cold start. Every run is `configs/tiny.py` with `--config.seed=S --config.stagebank.seed=S` and
`--config.curriculum.mode=M` (the held-out cells stay fixed by `evaluator.seed`); the first mode
of a seed does tokenizer, SFT rows, SFT and the SFT evaluation, the others start from a copy of
exactly those files (`fork_cold_start`), so they differ only in what the curriculum does
afterwards. Rerun the same command (or another `--modes` / `--seeds` slice) on the same root:
finished runs are skipped, killed ones resume.

  python experiments/tiny_study.py --root=runs/tiny_study                       # everything
  python experiments/tiny_study.py --root=runs/tiny_study --modes=argmin,uniform --seeds=0
  python experiments/tiny_study.py --root=runs/tiny_study --collect_only

Results: ROOT/study.md (mean ± standard error over seeds of held-out overall and of each stage,
after SFT and after each round; final overall with its paired difference to uniform; each
round's target stage before / after its round; loop health), ROOT/study.json and ROOT/study.png
(one panel per stage and overall, one line per mode).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # noqa: E402

from bat_jax.io_utils import atomic_write_json  # noqa: E402

MODES = ("argmin", "softmin", "uniform", "e2e_only", "reach_argmin")
CONFIG = sweep.CONFIG
# What a forked run copies from its seed's first run: everything the cold start produced. The
# run secret keys the held-out cells: without it a fork's evaluations would not be paired with
# the copied SFT evaluation (nor covered by the copied marker export).
COLD_START_PATHS = ("tokenizer", "stagebank/sft", "stagebank/markers.json", "ckpt/sft",
                    "policies/sft", "evals/sft.json", "eval_secret", "xla_cache")
_pm = sweep.mean_se
# Held-out cells per track in every study run (105 in all): one cell is then ~1% of overall and
# ~2-3% of a stage, so a round's change is not one cell's story (issue 23: >= 15; the main job
# keeps 6 for its time). A shared `-- --config.evaluator.cells_per_track=N` overrides it.
CELLS_PER_TRACK = 15
SEEDS = "0,1,2,3,4"


def run_dir(root: Path, seed: int, mode: str) -> Path:
  return root / f"seed_{seed}" / mode


def _cold_done(workdir: Path) -> bool:
  state = workdir / "outer_state.json"
  return (workdir / "evals" / "sft.json").is_file() and state.is_file() \
      and json.loads(state.read_text()).get("sft_done", False)


def fork_cold_start(source: Path, target: Path, mode: str,
                    overrides: Optional[Mapping[str, Any]] = None) -> None:
  """Starts `target` from `source`'s cold start: its files, its config with `mode` (and any
  dotted-key `overrides`, e.g. `{"grpo.advantage.mode": "placebo"}`: launch it with the same
  `--config.` flags), and an outer state holding only the SFT phase (so the curriculum picks its
  first target itself)."""
  if target.exists():
    return
  config = json.loads((source / "config.json").read_text())
  config["curriculum"]["mode"] = mode
  for dotted, value in (overrides or {}).items():   # checked before anything is copied
    *parents, leaf = dotted.split(".")
    section = config
    for name in parents:
      section = section.get(name, {})
    if leaf not in section:
      raise KeyError(f"fork override {dotted!r}: the source config has no such field")
    section[leaf] = value
  tmp = target.with_name(target.name + ".forking")
  shutil.rmtree(tmp, ignore_errors=True)
  for rel in COLD_START_PATHS:
    src = source / rel
    if src.is_dir():
      shutil.copytree(src, tmp / rel)
    elif src.is_file():
      (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(src, tmp / rel)
  atomic_write_json(tmp / "config.json", config)
  state = json.loads((source / "outer_state.json").read_text())
  atomic_write_json(tmp / "outer_state.json", {
      "sft_done": True, "sft_validation_nll": state["sft_validation_nll"], "baseline": "sft",
      "next_weights": None, "rounds": [], "evaluations": {"sft": state["evaluations"]["sft"]},
      "phase_seconds": {k: 0.0 for k in state["phase_seconds"]}})
  tmp.rename(target)


def study_runs(root: Path, modes: Sequence[str], seeds: Sequence[int],
               extra: Sequence[str]) -> list[sweep.Run]:
  """mode x seed runs in ROOT/seed_<S>/<mode> (the sweep machinery's runs, this layout)."""
  return sweep.make_runs(root, [(m, {"curriculum.mode": m, "logging.progress": False,
                                     "evaluator.cells_per_track": CELLS_PER_TRACK})
                                for m in modes], seeds, extra,
                         workdir=lambda root, mode, seed: run_dir(root, seed, mode))


def run_study(root: Path, runs: Sequence[sweep.Run], parallel: int,
              progress=print, launch: Path = sweep.ROOT / "launch.py") -> list[sweep.Run]:
  """Runs (or resumes) every run; per seed, the first mode does the shared cold start and the
  others fork from it. Returns the failed runs (a failed cold start fails its seed)."""
  seeds = sorted({r.seed for r in runs})
  sources = {s: next((d for d in (run_dir(root, s, m) for m in MODES) if _cold_done(d)), None)
             for s in seeds}
  first = [next(r for r in runs if r.seed == s) for s in seeds if sources[s] is None]
  if first:
    progress(f"cold start first: {', '.join(r.name for r in first)}")
  failed = sweep.run_all(CONFIG, first, parallel=parallel, progress=progress, launch=launch)
  for r in first:
    if r not in failed:
      sources[r.seed] = r.workdir
  rest = []
  for r in runs:
    if r in first:
      continue
    if sources[r.seed] is None:
      progress(f"skipped  {r.name}: the seed's cold start failed")
      failed.append(r)
      continue
    if r.workdir != sources[r.seed]:
      fork_cold_start(sources[r.seed], r.workdir, r.label)
    rest.append(r)
  return failed + sweep.run_all(CONFIG, rest, parallel=parallel, progress=progress,
                                launch=launch)


# --- the study's own tables (the scores table and the plot are the sweep's) ---------------------

def _final_overall(report: dict[str, Any]) -> float:
  """The last round's candidate, promoted or not."""
  return report["evaluations"][-1]["overall"]


def _accepted_overall(report: dict[str, Any]) -> float:
  """The policy the run hands on: the last one the gate promoted (`baseline`; SFT if none)."""
  return next(e["overall"] for e in report["evaluations"] if e["policy"] == report["baseline"])


def _mode_rows(reports: sweep.Reports, score, reference: str) -> list[str]:
  base = reports.get(reference, {})
  lines = []
  for mode, by_seed in reports.items():
    finals = [score(r) for r in by_seed.values()]
    gains = [score(r) - r["evaluations"][0]["overall"] for r in by_seed.values()]
    paired = [score(r) - score(base[s]) for s, r in by_seed.items() if s in base]
    lines.append(f"| {mode} | {len(finals)} | {_pm(finals)} | {_pm(gains)} | "
                 f"{_pm(paired) if mode != reference else '-'} |")
  return lines


def final_table(reports: sweep.Reports, reference: str = "uniform") -> list[str]:
  """Per mode, the held-out overall of the last round's candidate and of the accepted policy
  (what the gate let through), each with its gain over the mode's own SFT policy and its paired
  difference to `reference` over the seeds both finished (same cold start, so the pairing
  removes the seed's SFT luck from the comparison)."""
  lines = []
  for title, score, what in (("Final held-out overall per mode", _final_overall, "final"),
                             ("Accepted policy's held-out overall per mode", _accepted_overall,
                              "accepted")):
    lines += [f"## {title}", "",
              f"| mode | seeds | {what} overall | {what} - SFT | {what} - {reference} (paired) |",
              "|---|---:|---:|---:|---:|"] + _mode_rows(reports, score, reference) + [""]
  return lines


def _heldback_gain(report: dict[str, Any]) -> Optional[float]:
  """The accepted policy minus SFT on the held-back cells (`accepted_vs_sft_heldback`): 0 when
  the gate promoted nothing (the accepted policy is SFT); None for a run without them."""
  change = report.get("accepted_vs_sft_heldback")
  if change is not None:
    return change["mean"]
  return 0.0 if report["baseline"] == "sft" else None


def heldback_table(reports: sweep.Reports, reference: str = "uniform") -> list[str]:
  """Per mode, the accepted policy's change over SFT on cells no gate decision or target saw,
  and its paired difference to `reference`; no table when no run has held-back cells."""
  gains = {mode: {s: g for s, r in by_seed.items() if (g := _heldback_gain(r)) is not None}
           for mode, by_seed in reports.items()}
  rows = []
  for mode, by_seed in gains.items():
    if by_seed:
      paired = [g - gains.get(reference, {})[s] for s, g in by_seed.items()
                if s in gains.get(reference, {})]
      rows.append(f"| {mode} | {len(by_seed)} | {_pm(list(by_seed.values()))} | "
                  f"{_pm(paired) if mode != reference else '-'} |")
  if not rows:
    return []
  return ["## Accepted policy minus SFT on the held-back cells", "",
          "`evaluator.heldback_cells_per_track` cells a track that no gate decision or target "
          "saw; 0 for a seed whose gate promoted nothing.", "",
          f"| mode | seeds | accepted - SFT, held back | - {reference} (paired) |",
          "|---|---:|---:|---:|"] + rows + [""]


def _target_lines(reports: sweep.Reports) -> list[str]:
  lines = ["## Each round's target stage, before and after its round", "",
           "Modes that target no stage (uniform, e2e_only) have no rows here.", "",
           "| mode | round | targets (per seed) | before | after | after - before |",
           "|---|---:|---|---:|---:|---:|"]
  for mode, by_seed in reports.items():
    n_rounds = min(len(r.get("target_before_after", [])) for r in by_seed.values())
    for i in range(n_rounds):
      if all("weights" in r["rounds"][i] and sweep.round_target(r["rounds"][i]) is None
             for r in by_seed.values()):
        continue  # the curriculum targeted no stage this round
      rows = [r["target_before_after"][i] for r in by_seed.values()]
      ok = [t for t in rows if t["before"] is not None and t["after"] is not None]
      lines.append(f"| {mode} | {i} | {','.join(t['target'] for t in rows)} | "
                   f"{_pm([t['before'] for t in ok])} | {_pm([t['after'] for t in ok])} | "
                   f"{_pm([t['after'] - t['before'] for t in ok])} |")
  return lines


def markdown(reports: sweep.Reports) -> str:
  lines = [sweep.scores_markdown(reports, "Tiny study")] + final_table(reports)
  lines += heldback_table(reports)
  lines += _target_lines(reports)
  lines += ["", "## Loop health", "", "| mode | seed | reward mean per round | "
            "GRPO steps applied |", "|---|---:|---|---:|"]
  for mode, by_seed in reports.items():
    for seed, r in sorted(by_seed.items()):
      rewards = ", ".join("null" if x["reward_mean"] is None else f"{x['reward_mean']:.3f}"
                          for x in r["rounds"])
      lines.append(f"| {mode} | {seed} | {rewards} | {r.get('grpo_steps_applied', '?')} of "
                   f"{r.get('grpo_steps_total', '?')} |")
  return "\n".join(lines + [""])


def write_study(root: Path, runs: Sequence[sweep.Run]) -> Optional[str]:
  reports = sweep.collect(runs)
  return sweep.write_outputs(root, reports, "study", "Tiny study",
                             markdown(reports) if reports else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
  own, extra = sweep.split_shared(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", type=Path, default=Path("runs/tiny_study"))
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--seeds", default=SEEDS)
  parser.add_argument("--parallel", type=int, default=1, help="runs at once")
  parser.add_argument("--launch", type=Path, default=sweep.ROOT / "launch.py",
                      help="the script each run executes, with launch.py's flags")
  parser.add_argument("--collect_only", action="store_true")
  args = parser.parse_args(own)
  modes = [m for m in args.modes.split(",") if m]
  unknown = [m for m in modes if m not in MODES]
  if unknown:
    parser.error(f"--modes: unknown mode(s) {unknown}; expected some of {MODES}")
  seeds = [int(s) for s in args.seeds.split(",") if s]
  root = args.root.absolute()
  runs = study_runs(root, modes, seeds, extra)
  failed: list[sweep.Run] = []
  if not args.collect_only:
    problems = sweep.validate_runs(CONFIG, runs)
    if problems:
      print("tiny_study: nothing started; invalid runs:\n  " + "\n  ".join(problems),
            file=sys.stderr)
      return 2
    failed = run_study(root, runs, args.parallel, launch=args.launch,
                       progress=lambda line: print(line, flush=True))
  text = write_study(root, runs)
  print(text or f"no finished runs under {root}")
  if failed:
    print(f"tiny_study: {len(failed)} run(s) failed: " + ", ".join(r.name for r in failed),
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
