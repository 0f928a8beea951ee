"""Multi-host pieces of the outer loop: one process per host under `jax.distributed`.

Every process runs the same loop. Process 0 alone writes the shared files (run config, outer
state, reports, TensorBoard, exported policies) and spawns the Stage Bank; `primary_first` runs a
cached, idempotent setup step on process 0, then a barrier, then on the others (which find the
result on disk). GRPO rows are split across processes in whole state_id groups: each process
rolls its groups out on its own engine and contributes its rows to the global batch, so group
baselines never need another process's rewards. With one process every helper is a no-op.
Placing trees onto shardings that span processes is `bat_jax.train.placement`'s job.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

T = TypeVar("T")

# How each rollout statistic combines across processes (anything else: the mean).
_SUMMED = ("errors", "aborted", "excluded_trajectories", "dropped_groups")
_MAXED = ("reward_max", "length", "sampler_gap_max")


def is_primary() -> bool:
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Every process waits here until all have arrived (no-op with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def primary_first(name: str, fn: Callable[[], T]) -> T:
  """`fn()` on process 0, a barrier, then `fn()` on the others; `fn` must cache its result on
  disk (the others then only read it)."""
  out = fn() if is_primary() else None
  barrier(name)
  return out if is_primary() else fn()


def split_groups(items: Sequence[T], key: Callable[[T], str]) -> list[T]:
  """This process's share of a batch: whole groups (items with equal `key`, e.g. state_id),
  dealt round-robin in first-seen order.

  Raises:
    ValueError: when the groups do not split evenly (processes must contribute equal rows).
  """
  count, index = jax.process_count(), jax.process_index()
  if count == 1:
    return list(items)
  order: dict[str, list[T]] = {}
  for item in items:
    order.setdefault(key(item), []).append(item)
  shares = [[] for _ in range(count)]
  for g, group in enumerate(order.values()):
    shares[g % count].extend(group)
  if len({len(s) for s in shares}) != 1:
    raise ValueError(f"a batch of {len(items)} rows in {len(order)} state_id groups does not "
                     f"split evenly over {count} processes (grpo.prompt_groups must be a "
                     "multiple of the process count)")
  return shares[index]


def agree_max(value: int) -> int:
  """The largest `value` over all processes."""
  if jax.process_count() == 1:
    return int(value)
  return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def agree_any(flag: bool) -> bool:
  """True when `flag` holds on any process (so every process takes the same branch)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.asarray(bool(flag)))))


def combine_stats(stats: Mapping[str, float]) -> dict[str, float]:
  """Rollout statistics of all processes' rows: counts summed, maxima maxed, the rest averaged
  (each process holds the same number of rows)."""
  if jax.process_count() == 1:
    return dict(stats)
  keys = sorted(stats)
  table = multihost_utils.process_allgather(np.asarray([stats[k] for k in keys], np.float64))
  out = {}
  for i, k in enumerate(keys):
    column = np.asarray(table)[:, i]
    out[k] = float(column.sum() if k in _SUMMED else column.max() if k in _MAXED
                   else column.mean())
  return out
