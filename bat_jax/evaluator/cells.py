"""Paired evaluation cells, fixed by seed, and the digests a gate uses to check pairing.

A cell is (track, outcome, seed, tier): one held-out task run end to end. The cell set depends
only on (run secret, evaluator seed, cells per track, tier, tracks), so a baseline and a
candidate evaluated with the same settings in one run see exactly the same tasks.
`cell_set_digest` names that set; `protocol_digest` also covers everything else that changes
scores (generator version, rubric version and items, task metrics, stage weights, rollout
limits, sandbox limits), so two reports are comparable only when both digests agree.

The run secret keys the task seeds: without it, the evaluator seed and the public constants
would give every cell's seed, hence its task id, outcome and hidden values, to code in the
sandbox. It is drawn by the evaluator process (`new_secret`) and kept in its memory and, for
resume, in a host file no sandbox can see (`load_or_create_secret`: the run's WORKDIR, the CLI's
records folder); it never enters a workspace, an argv or an environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Optional, Sequence

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


_SECRET_RE = re.compile(r"[0-9a-f]{64}")


def new_secret() -> str:
  """A fresh run secret: 256 random bits as hex."""
  return secrets.token_hex(32)


def _check_secret(secret: Any, where: str) -> str:
  if not isinstance(secret, str) or not _SECRET_RE.fullmatch(secret):
    raise ValueError(f"{where} is not a run secret (64 lowercase hex digits)")
  return secret


def load_or_create_secret(path: Path) -> str:
  """The run secret stored at `path` (host side, mode 0600), created there on first use; a
  resumed run reads back the same one, so its cells are the same."""
  path = Path(path)
  try:
    return _check_secret(path.read_text().strip(), f"run secret file {path}")
  except FileNotFoundError:
    pass
  path.parent.mkdir(parents=True, exist_ok=True)
  secret = new_secret()
  try:  # O_EXCL: two processes racing to create it agree on the first one's
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
  except FileExistsError:
    return load_or_create_secret(path)
  with os.fdopen(fd, "w") as f:
    f.write(secret + "\n")
    f.flush()
    os.fsync(f.fileno())
  return secret


def make_cells(seed: int, cells_per_track: int, tier: str,
               tracks: Sequence[str] = workflow.TRACKS,
               action_space: str = "code", *,
               secret: Optional[str] = None) -> tuple[Cell, ...]:
  """`cells_per_track` cells per track, outcomes round-robin, 64-bit task seeds keyed by the
  run `secret` (HMAC-SHA256 of evaluator seed, track and index). Without a secret a fresh one
  is drawn: the cells are then unpredictable and unrepeatable (pass one to pair or resume)."""
  if cells_per_track < 1:
    raise ValueError(f"cells_per_track must be >= 1, got {cells_per_track}")
  secret = new_secret() if secret is None else secret
  key = bytes.fromhex(_check_secret(secret, "make_cells: secret"))
  cells = []
  for track in tracks:
    for i in range(cells_per_track):
      digest = hmac.digest(key, f"{seed}|{track}|{i}".encode(), "sha256")
      cells.append(Cell(track=track, outcome=workflow.OUTCOMES[i % len(workflow.OUTCOMES)],
                        seed=int.from_bytes(digest[:8], "big"), tier=tier,
                        action_space=action_space))
  if len(set(cells)) != len(cells):
    raise RuntimeError(f"duplicate cells for evaluator seed {seed}")  # 2^-64 per pair
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
