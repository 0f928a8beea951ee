"""The training side's expert sweep: every training track x outcome x focus x seed, scored.

The machinery (stage-boundary workspaces, expert episodes) is `bat_jax.taskkit.episodes`; this
module runs it over the training families (`FAMILIES`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bat_jax import workflow
from bat_jax.sandbox import SandboxLimits
from bat_jax.taskkit.episodes import expert_episode
from bat_jax.train_tasks.families import FAMILIES

SweepKey = tuple[str, str, str]  # (track, outcome, focus)


def _sweep_one(args: tuple[str, str, int, str, SandboxLimits]) -> dict[SweepKey, float]:
  """All foci of one (track, outcome, seed): E2E first, so stage rows start from its snapshots."""
  track, outcome, seed, root, limits = args
  instance = FAMILIES[track].generate(seed, outcome)
  base = Path(root) / instance.task_id
  rewards = {}
  for focus in workflow.FOCI:
    ep = expert_episode(instance, focus, base / focus, limits, cache_dir=base / "cache")
    rewards[(track, outcome, focus)] = ep.result.reward
  shutil.rmtree(base, ignore_errors=True)
  return rewards


def expert_sweep(seeds: range, root: Path, *, tracks: tuple[str, ...] = workflow.TRACKS,
                 outcomes: tuple[str, ...] = workflow.OUTCOMES,
                 limits: SandboxLimits = SandboxLimits(),
                 processes: int = 1) -> dict[SweepKey, list[float]]:
  """Expert rewards for every track x outcome x focus (E2E and each stage boundary) x seed."""
  jobs = [(t, o, s, str(root), limits) for t in tracks for o in outcomes for s in seeds]
  if processes > 1:
    import multiprocessing  # only for sweeps; the sandbox itself is process-safe
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
      parts = pool.map(_sweep_one, jobs, chunksize=1)
  else:
    parts = [_sweep_one(j) for j in jobs]
  table: dict[SweepKey, list[float]] = {}
  for part in parts:
    for key, reward in part.items():
      table.setdefault(key, []).append(reward)
  return table
