"""Sandbox overhead per call, the expert's full-task throughput, and the 20-seed score table.

In one run:
  1. the sandbox's per-call overhead (ms), measured by `sandbox_overhead.measure_overhead`;
  2. the expert solver's full-task throughput: generate + run every stage in the sandbox + score,
     one E2E task per track x outcome, sequentially (tasks per minute, calls per task);
  3. the expert sweep: every track x outcome x focus (E2E and the S1..S5 boundaries) for
     --seeds seeds, printing the minimum reward per cell (Done means: all >= 0.95).

  PYTHONPATH=. python experiments/perf/tasks_throughput.py --seeds 20 --processes 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bat_jax import workflow
from bat_jax.sandbox import SandboxLimits
from bat_jax.train_tasks import FAMILIES, expert_episode
from bat_jax.train_tasks.sweep import expert_sweep
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere
from sandbox_overhead import measure_overhead  # noqa: E402

LIMITS = SandboxLimits(wall_s=60.0)


def full_task_throughput(seed: int = 1000) -> dict[str, float]:
  """E2E expert tasks per minute (one per track x outcome) and mean calls per task."""
  calls, n = 0, 0
  with tempfile.TemporaryDirectory(prefix="bat-tasks-perf-") as tmp:
    t0 = time.perf_counter()
    for track in workflow.TRACKS:
      for outcome in workflow.OUTCOMES:
        inst = FAMILIES[track].generate(seed, outcome)
        ep = expert_episode(inst, workflow.E2E, Path(tmp) / inst.task_id, LIMITS)
        if ep.result.reward < 0.95:
          raise RuntimeError(f"{inst.task_id}: expert reward {ep.result.reward}")
        calls += ep.calls
        n += 1
    elapsed = time.perf_counter() - t0
  return {"tasks_per_min": n / elapsed * 60, "calls_per_task": calls / n,
          "s_per_task": elapsed / n}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=20)
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--overhead-calls", type=int, default=20)
  args = parser.parse_args()

  overhead = measure_overhead(args.overhead_calls)
  print(f"sandbox: {overhead['sandbox_python_ms']:.1f} ms/python call, "
        f"{overhead['sandbox_bash_ms']:.1f} ms/bash call, overhead {overhead['overhead_ms']:.1f} "
        f"ms/call vs plain subprocess (ratio {overhead['ratio']:.2f}x)")
  tp = full_task_throughput()
  print(f"expert full task (E2E, sequential): {tp['tasks_per_min']:.1f} tasks/min, "
        f"{tp['s_per_task']:.2f} s/task, {tp['calls_per_task']:.1f} calls/task")

  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="bat-tasks-sweep-") as tmp:
    table = expert_sweep(range(args.seeds), Path(tmp), limits=LIMITS,
                         processes=args.processes)
  sweep_s = time.perf_counter() - t0
  rows = len(workflow.TRACKS) * len(workflow.OUTCOMES) * args.seeds * len(workflow.FOCI)
  print(f"\nexpert sweep: {args.seeds} seeds, {rows} rows in {sweep_s:.0f} s "
        f"({args.processes} processes)")
  print(f"min reward per track x outcome x focus ({args.seeds} seeds each)")
  print(f"{'track':15s}{'outcome':10s}" + "".join(f"{f:>7s}" for f in workflow.FOCI))
  for track in workflow.TRACKS:
    for outcome in workflow.OUTCOMES:
      cells = [min(table[(track, outcome, f)]) for f in workflow.FOCI]
      print(f"{track:15s}{outcome:10s}" + "".join(f"{c:7.3f}" for c in cells))
  worst = min(min(v) for v in table.values())
  print(f"min expert reward {worst:.3f} over {len(table)} cells x {args.seeds} seeds; "
        f"{tp['tasks_per_min']:.1f} tasks/min; sandbox overhead {overhead['overhead_ms']:.1f} "
        "ms/call")


if __name__ == "__main__":
  main()
