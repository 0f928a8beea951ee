r"""Ablation sweeps over a config by overrides, and their comparison table.

Each variant of a sweep (`configs/tiny_sweeps.py`: curriculum_mode, pool_mix, group_size) is one
`launch.py` run in ROOT/<label> with the variant's overrides plus any shared overrides, so every
variant runs the same GRPO steps and is evaluated on the same paired held-out cells. The table
(ROOT/comparison.md + .json) and plot (ROOT/comparison.png) show held-out scores after SFT and
after each round, at equal GRPO steps.

  python experiments/sweep.py --sweep=curriculum_mode --root=runs/sweep_mode \
      --variants=argmin,uniform -- --config.grpo.rounds=3
  python experiments/sweep.py --sweep=pool_mix --root=runs/sweep_pool --collect_only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bat_jax import workflow  # noqa: E402
from bat_jax.io_utils import atomic_write_json, atomic_write_text  # noqa: E402
from configs import tiny_sweeps  # noqa: E402


def override_flags(overrides: dict[str, Any]) -> list[str]:
  """`{"a.b": v}` -> `["--config.a.b=v"]` (tuples as Python literals, which config_flags reads)."""
  return [f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}"
          for k, v in overrides.items()]


def launch_variant(config: str, workdir: Path, overrides: dict[str, Any],
                   extra: Sequence[str]) -> subprocess.Popen:
  """Starts (or resumes: same workdir) one variant's run; its log goes to WORKDIR.log."""
  workdir.parent.mkdir(parents=True, exist_ok=True)
  argv = [sys.executable, str(ROOT / "launch.py"), f"--config={config}", f"--workdir={workdir}",
          *override_flags(overrides), *extra]
  log = open(workdir.with_suffix(".log"), "ab")  # noqa: SIM115 (closed with the process)
  return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def collect(root: Path, labels: Sequence[str]) -> dict[str, Any]:
  """Per variant: held-out scores per evaluation, targets, gate decisions, GRPO steps."""
  rows = {}
  for label in labels:
    path = root / label / "report.json"
    if not path.is_file():
      rows[label] = None
      continue
    report = json.loads(path.read_text())
    rows[label] = {
        "evaluations": [{k: e[k] for k in ("policy", "overall", "task", "agentic",
                                           "stage_scores")} for e in report["evaluations"]],
        "targets": [r["target"] for r in report["rounds"]],
        "gate": ["pass" if r["gate"]["passed"] else "hold" for r in report["rounds"]],
        "grpo_steps": sum(r["grpo_steps"] for r in report["rounds"]),
        "reward_mean": [r["reward_mean"] for r in report["rounds"]],
        "phase_seconds": report["phase_seconds"],
    }
  return rows


def _fmt(x) -> str:
  return "null" if x is None else f"{x:.3f}"


def markdown(sweep: str, rows: dict[str, Any]) -> str:
  lines = [f"# Sweep `{sweep}`: held-out scores at equal GRPO steps", "",
           "| variant | GRPO steps | policy | overall | task | agentic | "
           + " | ".join(workflow.STAGES) + " | target | gate |",
           "|---|---:|---|---:|---:|---:|" + "---:|" * len(workflow.STAGES) + "---|---|"]
  for label, row in rows.items():
    if row is None:
      lines.append(f"| {label} | - | (no report yet) |" + " |" * (5 + len(workflow.STAGES)))
      continue
    for i, e in enumerate(row["evaluations"]):
      target = row["targets"][i - 1] if i else "-"
      decision = row["gate"][i - 1] if i else "-"
      lines.append(f"| {label} | {row['grpo_steps']} | {e['policy']} | {_fmt(e['overall'])} | "
                   f"{_fmt(e['task'])} | {_fmt(e['agentic'])} | "
                   + " | ".join(_fmt(e["stage_scores"][s]) for s in workflow.STAGES)
                   + f" | {target} | {decision} |")
  lines.append("")
  return "\n".join(lines)


def plot(sweep: str, rows: dict[str, Any], path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, row in rows.items():
    if row is None:
      continue
    ys = [e["overall"] for e in row["evaluations"]]
    ax.plot(range(len(ys)), ys, marker="o", label=label)
  ax.set_xlabel("evaluation (0 = after SFT, r = after round r)")
  ax.set_ylabel("held-out overall")
  ax.set_title(f"sweep {sweep}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_comparison(root: Path, sweep: str, labels: Sequence[str]) -> dict[str, Any]:
  rows = collect(root, labels)
  atomic_write_json(root / "comparison.json", {"sweep": sweep, "variants": rows})
  atomic_write_text(root / "comparison.md", markdown(sweep, rows))
  plot(sweep, rows, root / "comparison.png")
  return rows


def run_sweep(sweep: str, root: Path, *, config: str, labels: Sequence[str] | None,
              extra: Sequence[str], parallel: int, collect_only: bool) -> dict[str, Any]:
  variants = dict(tiny_sweeps.get_sweep(sweep))
  labels = list(labels or variants)
  unknown = [l for l in labels if l not in variants]
  if unknown:
    raise ValueError(f"sweep {sweep!r} has no variant(s) {unknown}; it has {list(variants)}")
  if not collect_only:
    pending = list(labels)
    running: list[tuple[str, subprocess.Popen]] = []
    while pending or running:
      while pending and len(running) < parallel:
        label = pending.pop(0)
        running.append((label, launch_variant(config, root / label, variants[label], extra)))
      label, proc = running.pop(0)
      if proc.wait() != 0:
        print(f"variant {label} failed (exit {proc.returncode}); see {root / label}.log",
              file=sys.stderr)
  return write_comparison(root, sweep, labels)


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  extra = argv[argv.index("--") + 1:] if "--" in argv else []
  own = argv[:argv.index("--")] if "--" in argv else argv
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sweep", required=True, choices=sorted(tiny_sweeps.SWEEPS))
  parser.add_argument("--root", type=Path, required=True)
  parser.add_argument("--config", default="configs/tiny.py")
  parser.add_argument("--variants", default=None, help="comma-separated labels (default: all)")
  parser.add_argument("--parallel", type=int, default=1, help="variants run at once")
  parser.add_argument("--collect_only", action="store_true")
  args = parser.parse_args(own)
  rows = run_sweep(args.sweep, args.root.absolute(), config=args.config,
                   labels=args.variants.split(",") if args.variants else None, extra=extra,
                   parallel=args.parallel, collect_only=args.collect_only)
  print(markdown(args.sweep, rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
