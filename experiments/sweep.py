r"""Sweeps over any config fields and seeds: validated first, streamed, resumable, with error bars.

Every run is one `launch.py` process in ROOT/<variant>/seed_<S> with the variant's overrides, the
seed's (`seed`, `stagebank.seed`) and the shared overrides after `--`; the held-out cells stay
fixed by `evaluator.seed`, so every run is scored on the same paired cells.

  python experiments/sweep.py --root=runs/sweep_lr --seeds=0,1,2 \
      --grid grpo.lr=1e-4,3e-4 --grid curriculum.mode=argmin,uniform -- --config.grpo.rounds=3
  python experiments/sweep.py --sweep=pool_mix --root=runs/sweep_pool      # configs/tiny_sweeps.py
  python experiments/sweep.py --root=runs/sweep_lr --grid ... --collect_only

- Before anything starts, every run's full config (file + variant + seed + shared overrides) is
  built and validated (`bat_jax.config_loading`, `bat_jax.config_validation`): one misspelt or
  out-of-range value stops the sweep with one line per bad run, naming the field.
- One progress line per run as it ends (done / FAILED with its log / skipped).
- Rerunning the same command resumes: a run whose report shows every round it was asked for is
  skipped, any other is rerun (`launch.py` resumes its workdir). The exit status is 1 if any run
  failed.
- ROOT/sweep.md (+ .json): held-out overall and per-stage scores after SFT and after each round,
  mean ± standard error over seeds; ROOT/sweep.png: one panel per stage (and overall), one line
  per variant with error bars, rounds on integer ticks.

`experiments/tiny_study.py` runs on this same machinery.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bat_jax import workflow  # noqa: E402
from bat_jax.bicurl.report import standard_error  # noqa: E402
from bat_jax.io_utils import atomic_write_json, atomic_write_text  # noqa: E402

CONFIG = str(ROOT / "configs" / "tiny.py")
Reports = dict[str, dict[int, dict[str, Any]]]  # variant -> seed -> report.json


@dataclasses.dataclass(frozen=True)
class Run:
  """One launch.py process: a variant at one seed."""
  label: str
  seed: int
  workdir: Path
  overrides: tuple[str, ...]   # `--config.a.b=v` flags: variant, seed and shared

  @property
  def name(self) -> str:
    return f"{self.label} seed {self.seed}"


# --- what runs ---------------------------------------------------------------------------------

def override_flags(overrides: dict[str, Any]) -> list[str]:
  """`{"a.b": v}` -> `["--config.a.b=v"]` (tuples as Python literals, which config_flags reads)."""
  return [f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}"
          for k, v in overrides.items()]


def _split_values(text: str) -> list[str]:
  """`a,b,(1, 2)` -> `["a", "b", "(1, 2)"]`: commas inside brackets stay in their value."""
  values, depth, cur = [], 0, ""
  for ch in text:
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      values.append(cur.strip())
      cur = ""
    else:
      cur += ch
  return [v for v in values + [cur.strip()] if v]


def parse_grid(items: Sequence[str]) -> list[tuple[str, list[str]]]:
  """`["grpo.lr=1e-4,3e-4", ...]` -> `[("grpo.lr", ["1e-4", "3e-4"]), ...]`."""
  grid = []
  for item in items:
    field, eq, values = item.partition("=")
    field = field.strip().removeprefix("--config.").removeprefix("config.")
    if not eq or not field or not _split_values(values):
      raise ValueError(f"--grid {item!r}: expected FIELD=V1,V2,... (e.g. grpo.lr=1e-4,3e-4)")
    grid.append((field, _split_values(values)))
  fields = [f for f, _ in grid]
  if len(set(fields)) != len(fields):
    raise ValueError(f"--grid: a field appears twice in {fields}")
  return grid


def grid_variants(grid: list[tuple[str, list[str]]]) -> list[tuple[str, dict[str, str]]]:
  """The cartesian product of the grid, as `(label, {field: value})`; label `f=v,g=w`."""
  variants = []
  for combo in itertools.product(*(values for _, values in grid)):
    overrides = {field: value for (field, _), value in zip(grid, combo)}
    variants.append((",".join(f"{k}={v}" for k, v in overrides.items()), overrides))
  return variants


def dir_name(label: str) -> str:
  return re.sub(r"[^A-Za-z0-9._=,+-]", "_", label) or "default"


def make_runs(root: Path, variants: Sequence[tuple[str, dict[str, Any]]], seeds: Sequence[int],
              shared: Sequence[str],
              workdir: Callable[[Path, str, int], Path] = lambda root, label, seed:
              root / dir_name(label) / f"seed_{seed}") -> list[Run]:
  """Variant x seed runs; each run's seed sets `seed` and `stagebank.seed`."""
  return [Run(label, seed, workdir(root, label, seed),
              tuple(override_flags({**overrides, "seed": seed, "stagebank.seed": seed}))
              + tuple(shared))
          for label, overrides in variants for seed in seeds]


def validate_runs(config: str, runs: Sequence[Run]) -> list[str]:
  """Builds and validates every run's full config; one line per bad run (empty: all good)."""
  from bat_jax.config_loading import ConfigLoadError, load_config
  from bat_jax.config_validation import ConfigError, validate_config
  problems = []
  for run in runs:
    try:
      validate_config(load_config(config, run.overrides))
    except ConfigLoadError as e:
      problems.append(f"{run.name}: {e}")
    except ConfigError as e:
      problems.append(f"{run.name}: " + "; ".join(l.strip() for l in str(e).splitlines()[1:]))
  return problems


def config_path(config: str) -> str:
  """`configs/x.py[:arg]` made absolute (from here, else from the repository), so that the
  validation here and the runs (started in the repository) read the same file."""
  path, colon, arg = config.partition(":")
  here = Path(path).absolute()
  full = here if here.exists() or Path(path).is_absolute() else ROOT / path
  return f"{full}{colon}{arg}"


# --- running -----------------------------------------------------------------------------------

def finished(workdir: Path) -> bool:
  """Whether a run finished: its report shows every round its config asks for."""
  report, config = workdir / "report.json", workdir / "config.json"
  try:
    return json.loads(report.read_text())["finished_rounds"] >= \
        json.loads(config.read_text())["grpo"]["rounds"]
  except (OSError, ValueError, KeyError, TypeError):
    return False


def _start(config: str, run: Run, launch: Path) -> subprocess.Popen:
  run.workdir.parent.mkdir(parents=True, exist_ok=True)
  argv = [sys.executable, str(launch), f"--config={config}", f"--workdir={run.workdir}",
          *run.overrides]
  log = open(run.workdir.with_suffix(".log"), "ab")  # noqa: SIM115 (closed with the process)
  return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _last_line(path: Path) -> str:
  try:
    lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
  except OSError:
    return ""
  return lines[-1].strip()[:200] if lines else ""


def _outcome(run: Run, code: int, seconds: float) -> tuple[bool, str]:
  if code == 0 and finished(run.workdir):
    report = json.loads((run.workdir / "report.json").read_text())
    evals = report["evaluations"]
    return True, (f"done     {run.name}: {seconds:.0f} s, held-out overall "
                  f"{evals[0]['overall']:.3f} (sft) -> {evals[-1]['overall']:.3f} "
                  f"({evals[-1]['policy']})")
  why = f"exit {code}" if code else "exit 0 without a finished report"
  log = run.workdir.with_suffix(".log")
  return False, f"FAILED   {run.name}: {why} after {seconds:.0f} s; log {log}: {_last_line(log)}"


def run_all(config: str, runs: Sequence[Run], *, parallel: int = 1, launch: Path = ROOT /
            "launch.py", progress: Callable[[str], None] = print) -> list[Run]:
  """Runs every unfinished run (`parallel` at once), one progress line per run; returns the
  runs that failed."""
  total, done = len(runs), 0
  failed: list[Run] = []
  pending = []
  for run in runs:
    if finished(run.workdir):
      done += 1
      progress(f"[{done}/{total}] skipped  {run.name}: finished earlier")
    else:
      pending.append(run)
  running: list[tuple[Run, subprocess.Popen, float]] = []
  while pending or running:
    while pending and len(running) < parallel:
      run = pending.pop(0)
      running.append((run, _start(config, run, launch), time.monotonic()))
    time.sleep(0.2)
    for item in [r for r in running if r[1].poll() is not None]:
      running.remove(item)
      run, proc, t0 = item
      ok, line = _outcome(run, proc.returncode, time.monotonic() - t0)
      done += 1
      progress(f"[{done}/{total}] {line}")
      if not ok:
        failed.append(run)
  return failed


# --- tables and plots --------------------------------------------------------------------------

def collect(runs: Sequence[Run]) -> Reports:
  """variant -> seed -> report.json, for every run that finished."""
  out: Reports = {}
  for run in runs:
    if finished(run.workdir):
      out.setdefault(run.label, {})[run.seed] = json.loads(
          (run.workdir / "report.json").read_text())
  return out


def mean_se(values: Sequence[float]) -> str:
  if not values:
    return "-"
  se = standard_error(list(values))
  return f"{sum(values) / len(values):.3f}" + ("" if se is None else f" ± {se:.3f}")


def round_target(r: dict[str, Any]) -> Optional[str]:
  """The stage a round targeted, or None when its curriculum targets none (uniform stage
  weights, e2e_only's empty S-target pool): the report's `target` is then only a label."""
  weights = r.get("weights")
  if not weights:
    return r.get("target")
  stage_w = weights.get("stage_weights", {})
  top = max(stage_w.values(), default=0.0)
  if weights.get("pool_mix", {}).get("s_target", 1.0) <= 0 or \
      sum(1 for w in stage_w.values() if w >= top - 1e-9) != 1:
    return None
  return r.get("target")


def _score(e: dict[str, Any], key: str) -> Optional[float]:
  return e["overall"] if key == "overall" else e["stage_scores"].get(key)


def scores_markdown(reports: Reports, title: str) -> str:
  """Per variant and evaluation: held-out overall and stages, mean ± standard error over seeds."""
  keys = ["overall", *workflow.STAGES]
  lines = [f"# {title}: held-out scores, mean ± standard error over seeds", "",
           "| variant | seeds | policy | GRPO steps | " + " | ".join(keys) + " | target |",
           "|---|---:|---|---:|" + "---:|" * len(keys) + "---|"]
  for label, by_seed in reports.items():
    n_evals = min(len(r["evaluations"]) for r in by_seed.values())
    for i in range(n_evals):
      evals = [r["evaluations"][i] for r in by_seed.values()]
      steps = sorted({sum(x["grpo_steps"] for x in r["rounds"][:i]) for r in by_seed.values()})
      targets = [round_target(r["rounds"][i - 1]) if i else None for r in by_seed.values()]
      target = ",".join(t for t in targets if t) if any(targets) else "-"
      cells = [mean_se([v for e in evals if (v := _score(e, k)) is not None]) for k in keys]
      lines.append(f"| {label} | {len(evals)} | {evals[0]['policy']} | "
                   f"{'/'.join(map(str, steps))} | " + " | ".join(cells) + f" | {target} |")
  return "\n".join(lines + [""])


def stages_figure(reports: Reports, title: str) -> Any:
  """One panel per stage and overall; one line per variant (mean ± SE over seeds)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  keys = ["overall", *workflow.STAGES]
  fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), sharey=True, squeeze=False)
  n_max = max((min(len(r["evaluations"]) for r in v.values()) for v in reports.values()),
              default=1)
  offsets = {label: (i - (len(reports) - 1) / 2) * 0.06 for i, label in enumerate(reports)}
  for ax, key in zip(axes.flat, keys):
    for label, by_seed in reports.items():
      n = min(len(r["evaluations"]) for r in by_seed.values())
      series = [[v for r in by_seed.values() if (v := _score(r["evaluations"][i], key))
                 is not None] for i in range(n)]
      xs = [i + offsets[label] for i in range(n)]  # dodge, so equal scores stay visible
      means = [sum(s) / len(s) if s else float("nan") for s in series]
      errs = [standard_error(s) or 0.0 for s in series]
      ax.errorbar(xs, means, yerr=errs, marker="o", capsize=2, label=label)
    ax.set_title(key, fontsize=9)
    ax.set_xticks(range(n_max), ["sft"] + [f"r{i + 1}" for i in range(n_max - 1)], fontsize=8)
    ax.set_ylim(-0.02, 1.02)
  for ax in axes[:, 0]:
    ax.set_ylabel("held-out score")
  axes[0][0].legend(fontsize=7)
  fig.suptitle(f"{title} (x: evaluation after SFT, after round r)", fontsize=10)
  fig.tight_layout()
  return fig


def plot_stages(reports: Reports, path: Path, title: str) -> None:
  import matplotlib.pyplot as plt
  fig = stages_figure(reports, title)
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_outputs(root: Path, reports: Reports, name: str, title: str,
                  markdown: Optional[str] = None) -> Optional[str]:
  """ROOT/NAME.md, .json and .png; None when nothing finished yet."""
  if not reports:
    return None
  text = markdown or scores_markdown(reports, title)
  atomic_write_json(root / f"{name}.json", {k: {str(s): r for s, r in v.items()}
                                            for k, v in reports.items()})
  atomic_write_text(root / f"{name}.md", text)
  plot_stages(reports, root / f"{name}.png", title)
  return text


# --- command line ------------------------------------------------------------------------------

def split_shared(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """(own flags, shared `--config.*` overrides after `--`)."""
  argv = list(argv)
  if "--" not in argv:
    return argv, []
  i = argv.index("--")
  return argv[:i], argv[i + 1:]


def _variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
  if args.sweep:
    from configs import tiny_sweeps
    variants = list(tiny_sweeps.get_sweep(args.sweep))
    return [v for v in variants if not args.variants or v[0] in args.variants.split(",")]
  return grid_variants(parse_grid(args.grid)) if args.grid else [("default", {})]


def main(argv: Optional[Sequence[str]] = None) -> int:
  own, shared = split_shared(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", type=Path, required=True)
  parser.add_argument("--config", default=CONFIG)
  parser.add_argument("--grid", action="append", default=[], metavar="FIELD=V1,V2",
                      help="a config field and its values (repeat for a product)")
  parser.add_argument("--sweep", default=None, help="a canned sweep of configs/tiny_sweeps.py")
  parser.add_argument("--variants", default=None, help="with --sweep: labels to run")
  parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
  parser.add_argument("--parallel", type=int, default=1, help="runs at once")
  parser.add_argument("--launch", type=Path, default=ROOT / "launch.py",
                      help="the script each run executes, with launch.py's flags")
  parser.add_argument("--collect_only", action="store_true")
  args = parser.parse_args(own)
  if args.sweep and args.grid:
    parser.error("give --grid or --sweep, not both")
  try:
    variants = _variants(args)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
  except ValueError as e:
    parser.error(str(e))
  if not variants or not seeds:
    parser.error("nothing to run: no variants or no seeds")
  runs = make_runs(args.root.absolute(), variants, seeds, shared)
  config = config_path(args.config)
  failed: list[Run] = []
  if not args.collect_only:
    problems = validate_runs(config, runs)
    if problems:
      print("sweep: nothing started; invalid runs:\n  " + "\n  ".join(problems), file=sys.stderr)
      return 2
    print(f"sweep: {len(runs)} runs ({len(variants)} variant(s) x {len(seeds)} seed(s)), "
          f"configs valid", flush=True)
    failed = run_all(config, runs, parallel=args.parallel, launch=args.launch,
                     progress=lambda line: print(line, flush=True))
  text = write_outputs(args.root.absolute(), collect(runs), "sweep",
                       "Sweep " + (args.sweep or " x ".join(f for f, _ in parse_grid(args.grid))
                                   or "default"))
  print(text or f"no finished runs under {args.root}")
  if failed:
    print(f"sweep: {len(failed)} of {len(runs)} run(s) failed: "
          + ", ".join(r.name for r in failed), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
