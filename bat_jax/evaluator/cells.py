"""Paired evaluation cells, fixed by seed, and the digests a gate uses to check pairing.

A cell is (track, outcome, seed, tier): one held-out task run end to end. The cell set depends
only on (evaluator seed, cells per track, tier, tracks), so a baseline and a candidate evaluated
with the same settings see exactly the same tasks. `cell_set_digest` names that set;
`protocol_digest` also covers everything else that changes scores (generator version, rubric
version and items, task metrics, stage weights, rollout limits, sandbox limits), so two reports are
comparable only when both digests agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Sequence

from bat_jax import rubric, workflow
from bat_jax.evaluator import generators
from bat_jax.rollout_protocol import RolloutLimits
from bat_jax.sandbox import SandboxLimits
from bat_jax.taskkit import TaskInstance


@dataclasses.dataclass(frozen=True, order=True)
class Cell:
  """One held-out task of the evaluation grid."""
  track: str
  outcome: str
  seed: int
  tier: str
  action_space: str = "code"   # workflow.ACTION_SPACES

  def __post_init__(self):
    workflow.check_action_space(self.action_space)
    if self.track not in workflow.TRACKS:
      raise ValueError(f"Cell.track {self.track!r} is not one of {workflow.TRACKS}")
    if self.outcome not in workflow.OUTCOMES:
      raise ValueError(f"Cell.outcome {self.outcome!r} is not one of {workflow.OUTCOMES}")
    if self.tier not in generators.TIERS:
      raise ValueError(f"Cell.tier {self.tier!r} is not one of {generators.TIERS}")

  @property
  def key(self) -> str:
    """A file-name-safe id (evaluator-side only: it reveals the seed)."""
    return f"{self.track}-{self.outcome}-{self.seed}-{self.tier}"

  def instance(self) -> TaskInstance:
    return generators.generate(self.track, self.seed, self.outcome, self.tier,
                               self.action_space)


def make_cells(seed: int, cells_per_track: int, tier: str,
               tracks: Sequence[str] = workflow.TRACKS,
               action_space: str = "code") -> tuple[Cell, ...]:
  """`cells_per_track` cells per track, outcomes round-robin, task seeds derived from `seed`."""
  if cells_per_track < 1:
    raise ValueError(f"cells_per_track must be >= 1, got {cells_per_track}")
  cells = []
  for track in tracks:
    for i in range(cells_per_track):
      digest = hashlib.sha256(f"{seed}|{track}|{i}".encode()).digest()
      cells.append(Cell(track=track, outcome=workflow.OUTCOMES[i % len(workflow.OUTCOMES)],
                        seed=int.from_bytes(digest[:4], "big"), tier=tier,
                        action_space=action_space))
  if len(set(cells)) != len(cells):
    raise RuntimeError(f"duplicate cells for evaluator seed {seed}")  # 2^-32 per pair
  return tuple(cells)


def _digest(obj: Any) -> str:
  blob = json.dumps(obj, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(blob.encode()).hexdigest()


def cell_set_digest(cells: Sequence[Cell]) -> str:
  """Order-free digest of the cell set (what the gate compares for pairing)."""
  return _digest(sorted(dataclasses.astuple(c) for c in cells))


def protocol_digest(cells: Sequence[Cell], limits: RolloutLimits,
                    sandbox_limits: SandboxLimits) -> str:
  """Digest of everything that defines the measurement, cells included."""
  return _digest({
      "generator": generators.GENERATOR_VERSION, "cells": cell_set_digest(cells),
      "rubric": rubric.RUBRIC_VERSION, "task_metrics": dict(workflow.TASK_METRICS),
      "stage_items": {s: list(v) for s, v in workflow.STAGE_ITEMS.items()},
      "stage_weights": dict(workflow.STAGE_WEIGHTS),
      "rollout_limits": dataclasses.asdict(limits),
      "sandbox_limits": dataclasses.asdict(sandbox_limits)})
