"""Held-out evaluator throughput: cells per minute with 1 and 2 worker processes.

Runs the oracle (the most expensive built-in agent: every stage, ~11-15 sandbox calls per cell)
on the same paired cell set with 1 and then 2 workers, and prints cells/min, s/cell and the
speed-up. Wall time includes worker start-up, workspace materialisation, every sandbox call and
rubric scoring, i.e. what `python -m bat_jax.evaluator` costs per cell.

  PYTHONPATH=. python experiments/perf/evaluator_throughput.py --cells-per-track 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bat_jax.evaluator import EvalSettings, RunOptions, evaluate


def measure(workers: int, settings: EvalSettings, agent: str) -> dict[str, float]:
  with tempfile.TemporaryDirectory(prefix="bat-eval-perf-") as tmp:
    t0 = time.perf_counter()
    report = evaluate(agent, Path(tmp) / "records", settings=settings,
                      options=RunOptions(workers=workers))
    elapsed = time.perf_counter() - t0
  if not report["validity"]["valid"]:
    raise RuntimeError(f"{workers} worker(s): invalid cells {report['failure_categories']}")
  n = report["completion"]["cells"]
  return {"cells": n, "cells_per_min": n / elapsed * 60, "s_per_cell": elapsed / n,
          "overall": report["overall"]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cells-per-track", type=int, default=3)
  parser.add_argument("--tier", default="lite")
  parser.add_argument("--agent", default="oracle")
  args = parser.parse_args()
  settings = EvalSettings(tier=args.tier, cells_per_track=args.cells_per_track, seed=777)
  results = {}
  for workers in (1, 2):
    r = measure(workers, settings, args.agent)
    results[workers] = r
    print(f"{workers} worker(s): {r['cells']} cells, {r['cells_per_min']:.1f} cells/min, "
          f"{r['s_per_cell']:.2f} s/cell, overall {r['overall']:.3f}", flush=True)
  speedup = results[2]["cells_per_min"] / results[1]["cells_per_min"]
  print(f"speed-up 2 vs 1 workers: {speedup:.2f}x")


if __name__ == "__main__":
  main()
