"""Stage Bank throughput: build + leak-check a reference 3,024-row round, then read it via grain.

    PYTHONPATH=. python experiments/perf/stagebank_build_read.py [--workers=N] [--markers=2000]

Prints one line per phase and, last, the two headline numbers: seconds to build and leak-check
the round, and rows/s read back through grain (digest verification included).
"""

from __future__ import annotations

import argparse
import random
import string
import tempfile
import time
from pathlib import Path

from bat_jax import markers
from bat_jax.stagebank import build
from bat_jax.stagebank import leakcheck
from bat_jax.stagebank import reader
from bat_jax.stagebank import rounds
from bat_jax.stagebank import task_source


def _fake_heldout_markers(n: int, rng: random.Random) -> list[str]:
  """Marker-like strings: ids, numeric answers, file names and report sentences."""
  words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 9))) for _ in range(500)]
  out = []
  for i in range(n):
    kind = i % 4
    if kind == 0:
      out.append(f"ho-{rng.randrange(10**6):06d}")
    elif kind == 1:
      out.append(f"{rng.uniform(0, 100):.4f}")
    elif kind == 2:
      out.append(f"{rng.choice(words)}_{rng.randrange(1000)}.pgm")
    else:
      out.append(" ".join(rng.choices(words, k=rng.randint(10, 30))))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--source", default=task_source.DEFAULT_SOURCE)
  parser.add_argument("--markers", type=int, default=2000, help="held-out markers to export")
  parser.add_argument("--n-batches", type=int, default=rounds.REFERENCE_BATCHES)
  parser.add_argument("--read-epochs", type=int, default=3)
  parser.add_argument("--workers", type=int, default=1, help="task-generation processes")
  args = parser.parse_args()

  export = markers.export_markers(_fake_heldout_markers(args.markers, random.Random(0)),
                                  salt="perf")
  spec = rounds.RoundSpec(1, rounds.RoundWeights.for_target("S3"), seed=0,
                          n_batches=args.n_batches)
  source = task_source.load_source_factory(args.source)()

  t0 = time.perf_counter()
  built = build.build_round(spec, source, leakcheck.LeakChecker(markers.MarkerMatcher(export)),
                            workers=args.workers)
  t_build = time.perf_counter() - t0
  n_rows = built.receipt.rows_checked
  print(f"build+leak-check: {n_rows} rows in {t_build:.2f}s ({n_rows / t_build:.0f} rows/s), "
        f"source={source.name}, markers={export['marker_count']}, workers={args.workers}")

  # The leak check alone, with cold memo tables.
  rows = [(pool, row) for pool, prows in built.pools.items() for row in prows]
  t0 = time.perf_counter()
  receipt = leakcheck.LeakChecker(markers.MarkerMatcher(export)).check_rows(rows)
  t_check = time.perf_counter() - t0
  assert receipt.passed
  print(f"leak-check only: {t_check:.2f}s ({n_rows / t_check:.0f} rows/s)")
  # The workspace files rows reset to (regenerated, digest-checked), also with cold memos.
  t0 = time.perf_counter()
  assert not build.scan_workspaces(leakcheck.LeakChecker(markers.MarkerMatcher(export)),
                                   built.pools)
  t_ws = time.perf_counter() - t0
  print(f"workspace scan only: {t_ws:.2f}s ({n_rows / t_ws:.0f} rows/s)")

  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    round_dir = build.publish(Path(tmp), built, source_name=source.name)
    t_pub = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in round_dir.iterdir())
    print(f"publish (ArrayRecord + manifest, fsync, rename): {t_pub:.2f}s, {size / 1e6:.1f} MB")

    t0 = time.perf_counter()
    rd = reader.RoundReader(round_dir, num_epochs=args.read_epochs, shuffle_seed=0)
    read = sum(len(batch) for batch in rd)
    t_read = time.perf_counter() - t0
    print(f"grain read: {read} rows ({args.read_epochs} epochs) in {t_read:.2f}s")
  print(f"RESULT build+leak-check {n_rows} rows: {t_build:.2f}s; "
        f"grain read: {read / t_read:.0f} rows/s")


if __name__ == "__main__":
  main()
