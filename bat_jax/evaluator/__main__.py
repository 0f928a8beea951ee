"""CLI: run a built-in agent over the held-out cells and write the aggregate report.

  python -m bat_jax.evaluator --agent=oracle --tier=lite --out=DIR

Prints progress per cell and the stage table; writes DIR/report.json (aggregate only, checked
by the firewall). Per-cell records go to --records (default: DIR.records, beside DIR, so the
export folder never holds them). --markers=PATH also writes the hashed marker export, which the
Stage Bank's leak pre-check reads; `--markers-only` writes just that (no evaluation, no --out):

  python -m bat_jax.evaluator --markers-only --markers=runs/markers.json [--tier=lite --seed=S]

The cells' task seeds are keyed by a run secret kept in --secret-file (default:
<records>/run_secret, or <markers>.run_secret with --markers-only; created on first use): a rerun
with the same file sees the same cells; give a baseline's and a candidate's evaluations (and the
marker export of their cells) the same file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from bat_jax import workflow
from bat_jax.evaluator import markers_export
from bat_jax.evaluator.agents import BUILTIN_AGENTS
from bat_jax.evaluator.aggregation import coverage_line
from bat_jax.evaluator.cells import load_or_create_secret
from bat_jax.evaluator.evaluate import EvalSettings, evaluate, stage_table
from bat_jax.evaluator.firewall import export_report
from bat_jax.evaluator.generators import TIERS
from bat_jax.evaluator.runner import RunOptions

REPORT_NAME = "report.json"


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m bat_jax.evaluator", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--agent", choices=BUILTIN_AGENTS, default="oracle")
  p.add_argument("--tier", choices=TIERS, default="lite")
  p.add_argument("--action-space", choices=workflow.ACTION_SPACES, default="code")
  p.add_argument("--out", type=Path, default=None,
                 help="export folder (report.json); required unless --markers-only")
  p.add_argument("--records", type=Path, default=None,
                 help="evaluator-side per-cell records (default: <out>.records)")
  p.add_argument("--seed", type=int, default=EvalSettings.seed)
  p.add_argument("--cells-per-track", type=int, default=EvalSettings.cells_per_track)
  p.add_argument("--tracks", default=",".join(workflow.TRACKS),
                 help="comma-separated subset of " + ",".join(workflow.TRACKS))
  p.add_argument("--workers", type=int, default=1, help="worker processes (0: in-process)")
  p.add_argument("--cell-timeout-s", type=float, default=RunOptions.cell_timeout_s)
  p.add_argument("--keep-workspaces", action="store_true")
  p.add_argument("--markers", type=Path, default=None, help="also write the hashed markers here")
  p.add_argument("--secret-file", type=Path, default=None,
                 help="run secret keying the cells (default: <records>/run_secret); share it "
                      "between evaluations that must be paired")
  p.add_argument("--markers-only", action="store_true",
                 help="only write the --markers export of the held-out cells, evaluate nothing")
  return p


def _progress(done: int, total: int, record: dict[str, Any]) -> None:
  cell = record["cell"]
  status = (f"overall={record['overall']:.3f}" if record["valid"]
            else f"INVALID ({record['invalid_reason']})")
  print(f"[{done:>3}/{total}] {cell['track']:<14} {cell['outcome']:<9} {status}",
        file=sys.stderr, flush=True)


def _settings(args: argparse.Namespace, tracks: tuple[str, ...], secret_file: Path) -> EvalSettings:
  return EvalSettings(tier=args.tier, seed=args.seed, cells_per_track=args.cells_per_track,
                      tracks=tracks, action_space=args.action_space,
                      secret=load_or_create_secret(secret_file))


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  tracks = tuple(t for t in args.tracks.split(",") if t)
  unknown = [t for t in tracks if t not in workflow.TRACKS]
  if unknown:
    raise SystemExit(f"--tracks: unknown track(s) {unknown}; expected {workflow.TRACKS}")
  if args.markers_only:
    if args.markers is None:
      raise SystemExit("--markers-only needs --markers=PATH (where to write the export)")
    secret_file = (args.secret_file
                   or args.markers.with_name(args.markers.name + ".run_secret")).resolve()
    settings = _settings(args, tracks, secret_file)
    markers_export.write_export(markers_export.export_cells(settings.cells()), args.markers)
    print(f"markers: {args.markers} ({len(settings.cells())} held-out cells, "
          f"run secret {secret_file})")
    return 0
  if args.out is None:
    raise SystemExit("--out is required (the export folder), unless --markers-only")
  out = args.out.resolve()
  records = (args.records or out.with_name(out.name + ".records")).resolve()
  if records == out or records.is_relative_to(out):
    raise SystemExit(f"--records {str(records)!r} must not lie inside the export folder --out")
  secret_file = (args.secret_file or records / "run_secret").resolve()
  if secret_file.is_relative_to(out):
    raise SystemExit(f"--secret-file {str(secret_file)!r} must not lie inside the export "
                     "folder --out")
  settings = _settings(args, tracks, secret_file)
  options = RunOptions(workers=args.workers, cell_timeout_s=args.cell_timeout_s,
                       keep_workspaces=args.keep_workspaces)
  print(f"evaluating agent {args.agent!r}, tier {args.tier}: {len(settings.cells())} cells, "
        f"{args.workers} worker(s)", file=sys.stderr, flush=True)
  report = evaluate(args.agent, records, settings=settings, options=options, progress=_progress)
  path = export_report(report, out / REPORT_NAME)
  if args.markers is not None:
    markers_export.write_export(markers_export.export_cells(settings.cells()), args.markers)
  print(stage_table(report))
  print(coverage_line(report))
  print(f"report: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
