"""Stage Bank CLI.

    python -m bat_jax.stagebank build --round=N --target=S3 --out=BANK
    python -m bat_jax.stagebank build --round=N --weights=weights.json --out=BANK
    python -m bat_jax.stagebank serve --bank=BANK
    python -m bat_jax.stagebank sft --out=BANK/sft --tasks-per-state=1
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from bat_jax.stagebank import build
from bat_jax.stagebank import daemon
from bat_jax.stagebank import leakcheck
from bat_jax.stagebank import rounds
from bat_jax.stagebank import sft_rows
from bat_jax.stagebank import task_source


def _add_allow_no_markers(p: argparse.ArgumentParser) -> None:
  p.add_argument("--allow-no-markers", action="store_true",
                 help="development only: publish without a held-out marker export (the leak "
                      "receipt records it); by default a missing export is an error")


def _add_common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--seed", type=int, default=0, help="base seed of the bank")
  p.add_argument("--n-batches", type=int, default=rounds.REFERENCE_BATCHES)
  p.add_argument("--rows-per-batch", type=int, default=rounds.REFERENCE_ROWS_PER_BATCH)
  p.add_argument("--markers", type=Path, default=None,
                 help="the evaluator's hashed marker export (default: BANK/markers.json)")
  _add_allow_no_markers(p)
  p.add_argument("--workers", type=int, default=1, help="processes for task generation")
  p.add_argument("--source", default=task_source.DEFAULT_SOURCE,
                 help="task source factory as module:attr (a TaskSource class or function)")


def _parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m bat_jax.stagebank", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  b = sub.add_parser("build", help="build and publish one round")
  b.add_argument("--round", type=int, required=True)
  b.add_argument("--out", type=Path, required=True, help="bank directory")
  group = b.add_mutually_exclusive_group(required=True)
  group.add_argument("--target", help="one-hot target stage with the reference 4/2/2 mix")
  group.add_argument("--weights", type=Path,
                     help='JSON file {"pool_mix": {...}, "stage_weights": {...}}')
  _add_common(b)
  s = sub.add_parser("serve", help="serve round requests written into BANK/requests/")
  s.add_argument("--bank", type=Path, required=True)
  s.add_argument("--poll-s", type=float, default=0.2)
  s.add_argument("--max-rounds", type=int, default=None, help="exit after this many requests")
  _add_common(s)
  f = sub.add_parser("sft", help="synthesise cold-start SFT rows from the expert solvers")
  f.add_argument("--out", type=Path, required=True, help="directory to publish")
  f.add_argument("--seed", type=int, default=0)
  f.add_argument("--tasks-per-state", type=int, default=1)
  f.add_argument("--markers", type=Path, default=None, help="the evaluator's hashed export")
  f.add_argument("--action-space", default="code", help="code | stage_tools")
  _add_allow_no_markers(f)
  return parser.parse_args(argv)


def _build(args: argparse.Namespace) -> Path:
  if args.target is not None:
    weights = rounds.RoundWeights.for_target(args.target)
  else:
    weights = rounds.RoundWeights.from_json(json.loads(args.weights.read_text()))
  spec = rounds.RoundSpec(args.round, weights, seed=args.seed, n_batches=args.n_batches,
                          rows_per_batch=args.rows_per_batch)
  return build.build_and_publish(args.out, spec, task_source.load_source_factory(args.source)(),
                                 markers_path=args.markers, workers=args.workers,
                                 allow_no_markers=args.allow_no_markers)


def _sft(args: argparse.Namespace) -> Path:
  matcher = build.load_matcher(args.markers, allow_no_markers=args.allow_no_markers)
  checker = leakcheck.LeakChecker(matcher, allow_no_markers=args.allow_no_markers)
  spec = sft_rows.SftSpec(seed=args.seed, tasks_per_state=args.tasks_per_state,
                          action_space=args.action_space)
  return sft_rows.build_sft_set(args.out, spec, checker)


def main(argv: list[str] | None = None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s stagebank %(message)s")
  if args.command == "serve":
    daemon.serve(args.bank, task_source.load_source_factory(args.source), seed=args.seed,
                n_batches=args.n_batches, rows_per_batch=args.rows_per_batch,
                markers_path=args.markers, poll_s=args.poll_s, max_rounds=args.max_rounds,
                workers=args.workers, allow_no_markers=args.allow_no_markers)
    return 0
  try:
    out = _sft(args) if args.command == "sft" else _build(args)
  except leakcheck.RoundRejected as e:
    print(json.dumps(e.receipt.to_json(), indent=1), file=sys.stderr)
    logging.error("%s", e)
    return 2
  except (FileNotFoundError, ValueError) as e:  # a missing / bad export or input: say which
    logging.error("%s", e)
    return 2
  print(out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
