"""Leak pre-check throughput: rows/s of `LeakChecker.check_rows` and of the workspace scan.

    PYTHONPATH=. python experiments/perf/leakcheck_throughput.py [--n-batches=6] [--repeats=3]

The rows are a real synthesised round (the default task source); the markers are the held-out
evaluator's real export (`markers_export.export_cells`). Each repeat uses a fresh matcher, so
every memo table starts cold, as in a build. Only public APIs that the base commit has too, so
the same script measures any checkout (run it with that checkout on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bat_jax import markers
from bat_jax.evaluator import markers_export
from bat_jax.evaluator.cells import make_cells
from bat_jax.stagebank import build, leakcheck, rounds, task_source


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--n-batches", type=int, default=rounds.REFERENCE_BATCHES)
  parser.add_argument("--cells-per-track", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  export = markers_export.export_cells(make_cells(20260901, args.cells_per_track, "lite"),
                                       salt=b"perf")
  spec = rounds.RoundSpec(1, rounds.RoundWeights.for_target("S3"), seed=0,
                          n_batches=args.n_batches)
  source = task_source.load_source_factory(task_source.DEFAULT_SOURCE)()
  empty = leakcheck.LeakChecker(markers.MarkerMatcher(markers.empty_export()),
                                allow_no_markers=True)
  built = build.build_round(spec, source, empty)
  rows = [(pool, row) for pool, prows in built.pools.items() for row in prows]
  rows_s, ws_s = [], []
  for _ in range(args.repeats):
    checker = leakcheck.LeakChecker(markers.MarkerMatcher(export))
    t0 = time.perf_counter()
    receipt = checker.check_rows(rows)
    rows_s.append(len(rows) / (time.perf_counter() - t0))
    assert receipt.passed, receipt.to_json()["samples"][:3]
    t0 = time.perf_counter()
    assert not build.scan_workspaces(checker, built.pools)
    ws_s.append(len(rows) / (time.perf_counter() - t0))
  print(f"markers={export['marker_count']} rows={len(rows)} repeats={args.repeats}")
  print("check_rows rows/s: " + " ".join(f"{r:.0f}" for r in rows_s))
  print("workspace scan rows/s: " + " ".join(f"{r:.0f}" for r in ws_s))
  print(f"RESULT leak-check {statistics.median(rows_s):.0f} rows/s, "
        f"workspace scan {statistics.median(ws_s):.0f} rows/s (medians)")


if __name__ == "__main__":
  main()
