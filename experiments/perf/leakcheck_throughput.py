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
  # Wall-clock and this process's CPU time: on a shared box the CPU figure is the steadier one.
  rates: dict[str, list[float]] = {"check wall": [], "check cpu": [], "workspace wall": [],
                                   "workspace cpu": []}
  for _ in range(args.repeats):
    checker = leakcheck.LeakChecker(markers.MarkerMatcher(export))
    t0, c0 = time.perf_counter(), time.process_time()
    receipt = checker.check_rows(rows)
    t1, c1 = time.perf_counter(), time.process_time()
    assert receipt.passed, receipt.to_json()["samples"][:3]
    assert not build.scan_workspaces(checker, built.pools)
    t2, c2 = time.perf_counter(), time.process_time()
    for key, seconds in (("check wall", t1 - t0), ("check cpu", c1 - c0),
                         ("workspace wall", t2 - t1), ("workspace cpu", c2 - c1)):
      rates[key].append(len(rows) / seconds)
  print(f"markers={export['marker_count']} rows={len(rows)} repeats={args.repeats}")
  for key, values in rates.items():
    print(f"{key} rows/s: " + " ".join(f"{r:.1f}" for r in values))
  print("RESULT rows/s (medians): " + ", ".join(
      f"{key} {statistics.median(values):.1f}" for key, values in rates.items()))


if __name__ == "__main__":
  main()
