"""Round views: which abstract state every row of a round starts from, in a deterministic order.

A round is laid out as `n_batches` batches of `rows_per_batch` rows. Every batch has the same
pool composition, apportioned from the curriculum's `pool_mix` (the reference 0.5/0.25/0.25 gives
4 S-target + 2 S-mix + 2 E2E of 8). Each pool is its own row sequence; batch `b` takes rows
`[b*k_p, (b+1)*k_p)` of pool `p`, so a round is fully described by its three pool sequences.

- S-target rows follow the curriculum's `stage_weights` (largest-remainder apportionment over the
  round, then spread evenly over the sequence), so a one-hot target gives only that stage.
- S-mix rows cycle round-robin over the stages other than the primary target (the largest stage
  weight, ties to the earliest stage).
- Within each (pool, stage) the rows cycle over the 21 (track, outcome) pairs, each cycle in a
  seeded order in which every prefix is balanced within one over tracks and over outcomes
  (`_balanced_cycle`): a round of 12 E2E rows holds 4 tasks of each outcome, not whatever a
  random permutation's first 12 gave (2 / 5 / 5 in the tiny run's round 0). Exactly balanced
  when counts divide by 21 (the reference round does).
- `state_id = sha256(round, source, pool, stage, index, seed)`: the GRPO group key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Mapping, Sequence

import numpy as np

from bat_jax import workflow

DATA_SOURCE = "bat_jax_stagebank"
REFERENCE_POOL_MIX: Mapping[str, float] = {"s_target": 0.5, "s_mix": 0.25, "e2e": 0.25}
REFERENCE_BATCHES = 378
REFERENCE_ROWS_PER_BATCH = 8
_SUM_TOL = 1e-4  # curriculum weights may come from float32 arrays


def _check_distribution(name: str, weights: Mapping[str, Any],
                        keys: Sequence[str]) -> dict[str, float]:
  """Validates a {key: weight} distribution over exactly `keys` and renormalises it."""
  if not isinstance(weights, Mapping):
    raise TypeError(f"{name} must be a mapping over {tuple(keys)}, got {type(weights).__name__}")
  if set(weights) != set(keys):
    raise ValueError(f"{name} keys {sorted(weights)} must be exactly {sorted(keys)}")
  out = {}
  for k in keys:
    v = float(weights[k])
    if not math.isfinite(v) or v < 0:
      raise ValueError(f"{name}[{k!r}] = {v} must be finite and >= 0")
    out[k] = v
  total = sum(out.values())
  if abs(total - 1.0) > _SUM_TOL:
    raise ValueError(f"{name} must sum to 1, got {total:.6f}")
  return {k: v / total for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class RoundWeights:
  """The curriculum's output for one round: pool and stage sampling weights.

  Attributes:
    pool_mix: {"s_target", "s_mix", "e2e"} -> weight, summing to 1.
    stage_weights: {"S1".."S5"} -> weight, summing to 1.
  """
  pool_mix: Mapping[str, float]
  stage_weights: Mapping[str, float]

  def __post_init__(self):
    object.__setattr__(self, "pool_mix",
                       _check_distribution("pool_mix", self.pool_mix, workflow.POOLS))
    object.__setattr__(self, "stage_weights",
                       _check_distribution("stage_weights", self.stage_weights, workflow.STAGES))

  @classmethod
  def for_target(cls, target: str,
                 pool_mix: Mapping[str, float] = REFERENCE_POOL_MIX) -> "RoundWeights":
    """BaT's rule: a one-hot target stage and (by default) the reference 4/2/2 mix."""
    if target not in workflow.STAGES:
      raise ValueError(f"unknown target stage {target!r}; expected one of {workflow.STAGES}")
    return cls(dict(pool_mix), {s: float(s == target) for s in workflow.STAGES})

  @classmethod
  def from_json(cls, weights: Any) -> "RoundWeights":
    """From `to_json()`'s form `{"pool_mix": {...}, "stage_weights": {...}}` (request files,
    the outer loop's state, the CLI)."""
    if not isinstance(weights, Mapping):
      raise TypeError("round weights must be a mapping with keys 'pool_mix' and "
                      f"'stage_weights', got {type(weights).__name__}")
    missing = {"pool_mix", "stage_weights"} - set(weights)
    if missing:
      raise ValueError(f"round weights are missing {sorted(missing)}")
    return cls(weights["pool_mix"], weights["stage_weights"])

  @property
  def primary_stage(self) -> str:
    """The stage with the largest weight (ties to the earliest): the round's target."""
    return max(workflow.STAGES, key=lambda s: (self.stage_weights[s], -workflow.STAGES.index(s)))

  def to_json(self) -> dict[str, dict[str, float]]:
    return {"pool_mix": dict(self.pool_mix), "stage_weights": dict(self.stage_weights)}


@dataclasses.dataclass(frozen=True)
class RoundSpec:
  """Everything a round view is a function of.

  Attributes:
    round_index: the BiCuRL round (>= 0).
    weights: the curriculum's weights.
    seed: base seed of the bank.
    n_batches: batches in the round (reference 378).
    rows_per_batch: rows per batch (reference 8).
    attempt: > 0 for a round built again after the leak check rejected the earlier attempt
      (`build.build_and_publish`): other tasks in the same slots.
  """
  round_index: int
  weights: RoundWeights
  seed: int = 0
  n_batches: int = REFERENCE_BATCHES
  rows_per_batch: int = REFERENCE_ROWS_PER_BATCH
  attempt: int = 0

  def __post_init__(self):
    for name in ("round_index", "seed", "attempt"):
      if getattr(self, name) < 0:
        raise ValueError(f"RoundSpec.{name} must be >= 0, got {getattr(self, name)}")
    for name in ("n_batches", "rows_per_batch"):
      if getattr(self, name) < 1:
        raise ValueError(f"RoundSpec.{name} must be >= 1, got {getattr(self, name)}")

  def to_json(self) -> dict[str, Any]:
    out = {"round": self.round_index, "seed": self.seed, "n_batches": self.n_batches,
           "rows_per_batch": self.rows_per_batch, "weights": self.weights.to_json()}
    return {**out, "attempt": self.attempt} if self.attempt else out


def apportion(weights: Sequence[float], total: int) -> list[int]:
  """Largest-remainder apportionment of `total` items by `weights` (ties to the earliest)."""
  wsum = float(sum(weights))
  if wsum <= 0:
    raise ValueError("cannot apportion over weights that sum to 0")
  quotas = [total * w / wsum for w in weights]
  counts = [math.floor(q + 1e-9) for q in quotas]
  order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
  for i in order[: total - sum(counts)]:
    counts[i] += 1
  return counts


def batch_composition(pool_mix: Mapping[str, float], rows_per_batch: int) -> dict[str, int]:
  """Rows of each pool in every batch: 0.5/0.25/0.25 of 8 -> s_target 4, s_mix 2, e2e 2."""
  counts = apportion([pool_mix[p] for p in workflow.POOLS], rows_per_batch)
  return dict(zip(workflow.POOLS, counts))


def spread(counts: Mapping[str, int]) -> list[str]:
  """Interleaves `counts[k]` copies of each key as evenly as possible (deterministic).

  At step t the key furthest behind its fair share `counts[k] * (t + 1) / total` goes next.
  """
  total = sum(counts.values())
  keys = [k for k in counts if counts[k] > 0]
  emitted = dict.fromkeys(keys, 0)
  out = []
  for t in range(total):
    k = max(keys, key=lambda k: (counts[k] * (t + 1) / total - emitted[k], -keys.index(k)))
    emitted[k] += 1
    out.append(k)
  return out


def state_id(round_index: int, source: str, pool: str, stage: str, index: int, seed: int) -> str:
  """The GRPO group key of a row: a hash of where it sits in the round."""
  blob = json.dumps([round_index, source, pool, stage, index, seed], separators=(",", ":"))
  return hashlib.sha256(blob.encode()).hexdigest()[:24]


def derive_seed(*parts: Any) -> int:
  """A 63-bit seed from JSON-able parts (stable across runs and platforms)."""
  blob = json.dumps(list(parts), separators=(",", ":")).encode()
  return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1


@dataclasses.dataclass(frozen=True)
class RowSlot:
  """One row of a round view, before any content is synthesised.

  Attributes:
    pool: "s_target" | "s_mix" | "e2e".
    index: position in the pool's sequence.
    stage: the row's focus: S1..S5 or E2E.
    track: task track.
    outcome: outcome bucket.
    task_seed: seed of the task generator for this row.
    state_id: GRPO group key.
  """
  pool: str
  index: int
  stage: str
  track: str
  outcome: str
  task_seed: int
  state_id: str


def _pool_stages(spec: RoundSpec, pool: str, n_rows: int) -> list[str]:
  """The focus of each of a pool's rows, in order."""
  weights = spec.weights
  if pool == "e2e":
    return [workflow.E2E] * n_rows
  if pool == "s_target":
    counts = apportion([weights.stage_weights[s] for s in workflow.STAGES], n_rows)
    return spread(dict(zip(workflow.STAGES, counts)))
  others = [s for s in workflow.STAGES if s != weights.primary_stage]
  return [others[i % len(others)] for i in range(n_rows)]


def _balanced_cycle(rng: np.random.Generator) -> list[tuple[str, str]]:
  """The 21 (track, outcome) pairs in a seeded order whose every prefix is balanced within one.

  Position i takes track `i mod 7` and outcome `i mod 3` of seeded orders of each: 7 and 3 are
  coprime, so the 21 positions meet every pair exactly once (Chinese remainders), and any run of
  consecutive positions cycles both marginals.
  """
  tracks, outcomes = workflow.TRACKS, workflow.OUTCOMES
  if math.gcd(len(tracks), len(outcomes)) != 1:
    raise ValueError(f"{len(tracks)} tracks and {len(outcomes)} outcomes share a factor: "
                     f"no order visits every pair with both marginals cycling")
  track_order = [tracks[int(i)] for i in rng.permutation(len(tracks))]
  outcome_order = [outcomes[int(i)] for i in rng.permutation(len(outcomes))]
  return [(track_order[i % len(tracks)], outcome_order[i % len(outcomes)])
          for i in range(len(tracks) * len(outcomes))]


def plan_round(spec: RoundSpec) -> dict[str, list[RowSlot]]:
  """The round view: for each pool, its rows in order (batch b takes the b-th block)."""
  composition = batch_composition(spec.weights.pool_mix, spec.rows_per_batch)
  n_cells = len(workflow.TRACKS) * len(workflow.OUTCOMES)
  # Attempt 0 keeps the seeds and ids rounds always had; a rebuild draws other tasks and ids.
  rebuild = (spec.attempt,) if spec.attempt else ()
  suffix = f"/rebuild{spec.attempt}" if spec.attempt else ""
  view: dict[str, list[RowSlot]] = {}
  for pool in workflow.POOLS:
    n_rows = composition[pool] * spec.n_batches
    stages = _pool_stages(spec, pool, n_rows)
    seen: dict[str, int] = {}
    cycle_order: dict[tuple[str, int], list[tuple[str, str]]] = {}
    slots = []
    for index, stage in enumerate(stages):
      k = seen.get(stage, 0)
      seen[stage] = k + 1
      cycle, pos = divmod(k, n_cells)
      if (stage, cycle) not in cycle_order:
        rng = np.random.default_rng(derive_seed(spec.seed, spec.round_index, pool, stage, cycle,
                                                *rebuild))
        cycle_order[(stage, cycle)] = _balanced_cycle(rng)
      track, outcome = cycle_order[(stage, cycle)][pos]
      sid = state_id(spec.round_index, DATA_SOURCE, pool + suffix, stage, index, spec.seed)
      slots.append(RowSlot(pool=pool, index=index, stage=stage, track=track, outcome=outcome,
                           task_seed=int(sid[:8], 16) & 0x7FFFFFFF, state_id=sid))
    view[pool] = slots
  return view
