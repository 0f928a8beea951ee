"""The outer loop's durable state and the run directory's layout.

Every phase of a run writes its result to a file under WORKDIR before the next phase starts, and
`OuterState` (WORKDIR/outer_state.json, written atomically) records which phases are done, so a
run killed at any point (SIGKILL included) restarts at the first unfinished phase:

  tokenizer/                 trained tokenizer (tiny) or a copy of the pretrained one's files
  stagebank/                 the Stage Bank directory (markers.json, sft/, round_NNNNNN/)
  ckpt/sft/                  orbax: cold-start SFT (train state + data position)
  ckpt/round_NNNNNN/         orbax: GRPO of one round (train state + reader state + round log)
  policies/<name>/           HF safetensors export of every evaluated policy (sft, round_NNNNNN)
  evals/<name>.json          the aggregate report of each evaluation (cached: re-run skipped);
                             heldback_<policy>.json on the held-back cells
  eval_records/<name>/       evaluator-side cell records (never read by training)
  eval_secret                the run secret keying the held-out cells' seeds (0600; never in
                             a sandbox): every evaluation of the run, resumed ones included,
                             sees the same cells
  config.json                the run's config (`check_same_config`: a resume must match it)
  tb/                        TensorBoard events
  report.json, report.md, *.png
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import ml_collections

from bat_jax.bicurl import multihost
from bat_jax.io_utils import atomic_write_json
from bat_jax.stagebank.rounds import RoundWeights
from bat_jax.stagebank.shards import round_dirname

PHASES: tuple[str, ...] = ("pretrain", "sft", "evaluation", "rollout", "update", "stagebank_wait")
STATE_FILE = "outer_state.json"


@dataclasses.dataclass(frozen=True)
class RunPaths:
  """Where each artifact of a run lives (see the module docstring)."""
  workdir: Path

  @property
  def tokenizer(self) -> Path:
    return self.workdir / "tokenizer"

  @property
  def stagebank(self) -> Path:
    return self.workdir / "stagebank"

  @property
  def sft_rows(self) -> Path:
    return self.stagebank / "sft"

  @property
  def markers(self) -> Path:
    return self.stagebank / "markers.json"

  @property
  def sft_checkpoints(self) -> Path:
    return self.workdir / "ckpt" / "sft"

  def round_checkpoints(self, round_index: int) -> Path:
    return self.workdir / "ckpt" / round_dirname(round_index)

  def policy(self, name: str) -> Path:
    return self.workdir / "policies" / name

  def eval_report(self, name: str) -> Path:
    return self.workdir / "evals" / f"{name}.json"

  def eval_records(self, name: str) -> Path:
    return self.workdir / "eval_records" / name

  @property
  def eval_secret(self) -> Path:
    return self.workdir / "eval_secret"

  @property
  def tensorboard(self) -> Path:
    return self.workdir / "tb"

  @property
  def logs(self) -> Path:
    return self.workdir / "logs"


@dataclasses.dataclass
class RoundRecord:
  """One finished BiCuRL round (everything the report shows about it).

  Attributes:
    round: round index (0-based).
    target: the weights' primary stage (largest weight, ties to the earliest): the one-hot
      target under argmin, only the first of equals under uniform.
    weights: the curriculum's weights the Stage Bank built the round with.
    start_policy: the policy the round started from (the last promoted one).
    candidate: the policy it produced (`round_NNNNNN`).
    gate: `GateDecision.to_dict()` of candidate vs baseline.
    promoted: whether the candidate became the new baseline.
    steps: per-step metrics (reward, KL, loss, ...), in order.
    healthy: no non-finite or skipped update in the round.
  """
  round: int
  target: str
  weights: RoundWeights
  start_policy: str
  candidate: str
  gate: dict[str, Any]
  promoted: bool
  steps: list[dict[str, float]]
  healthy: bool


@dataclasses.dataclass
class OuterState:
  """Which phases are done, the curriculum's history, and the time spent per phase.

  Attributes:
    pretrain: the tiny base's record (`bat_jax.pretrain.base`: probe copy accuracy, seconds,
      cache hit), for `model.source = "tiny_base"`; None otherwise.
    sft_done: the cold-start SFT finished and its policy is exported.
    sft_validation_nll: NLL per target token on the held-out SFT examples.
    baseline: name of the promoted policy (the gate's baseline, the next round's start).
    next_weights: the weights requested for round `len(rounds)` (None before the first
      evaluation).
    rounds: finished rounds.
    evaluations: policy name -> its aggregate report's headline (overall, task, stage scores).
    phase_seconds: wall time per phase (PHASES), summed over restarts.
  """
  pretrain: Optional[dict[str, Any]] = None
  sft_done: bool = False
  sft_validation_nll: Optional[float] = None
  baseline: Optional[str] = None
  next_weights: Optional[RoundWeights] = None
  rounds: list[RoundRecord] = dataclasses.field(default_factory=list)
  evaluations: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  phase_seconds: dict[str, float] = dataclasses.field(
      default_factory=lambda: {p: 0.0 for p in PHASES})

  @classmethod
  def load(cls, workdir: Path) -> "OuterState":
    """The saved state of `workdir`, or a fresh one."""
    path = Path(workdir) / STATE_FILE
    if not path.is_file():
      return cls()
    try:
      raw = json.loads(path.read_bytes())
      rounds = [RoundRecord(**{**r, "weights": RoundWeights.from_json(r["weights"])})
                for r in raw.pop("rounds")]
      if raw["next_weights"] is not None:
        raw["next_weights"] = RoundWeights.from_json(raw["next_weights"])
      return cls(rounds=rounds, **raw)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError,
            ValueError) as e:
      raise ValueError(f"outer-loop state {path} is unreadable ({e}); delete it to restart "
                       "the outer loop from its checkpoints") from None

  def save(self, workdir: Path) -> None:
    atomic_write_json(Path(workdir) / STATE_FILE, dataclasses.asdict(self))

  @contextlib.contextmanager
  def timed(self, phase: str) -> Iterator[None]:
    """Adds the wall time of the block to `phase_seconds[phase]`."""
    if phase not in PHASES:
      raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
    start = time.monotonic()
    try:
      yield
    finally:
      # .get: a state saved before a phase existed lacks its key
      self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + time.monotonic() - start


def heldback_name(policy: str) -> str:
  """The record name of `policy`'s evaluation on the held-back cells (`evals/<it>.json`)."""
  return f"heldback_{policy}"


def check_same_config(cfg: ml_collections.ConfigDict, path: Path) -> None:
  """Records the run's config; a resume with different values (`logging` aside) is refused,
  naming every field that differs, since it would mix two experiments in one directory."""
  current = json.loads(cfg.to_json_best_effort(sort_keys=True))
  if not path.is_file():
    if multihost.is_primary():
      atomic_write_json(path, current)
    return
  saved = json.loads(path.read_text())
  changed = sorted(k for k in set(saved) | set(current)
                   if k != "logging" and saved.get(k) != current.get(k))
  if changed:
    diffs = [f"{k}: {_diff(saved.get(k), current.get(k))}" for k in changed]
    raise ValueError(f"{path.parent} holds a run with another config; changed sections: "
                     + "; ".join(diffs) + ". Use a new --workdir.")


def _diff(saved: Any, current: Any, prefix: str = "") -> str:
  if isinstance(saved, dict) and isinstance(current, dict):
    return ", ".join(_diff(saved.get(k), current.get(k), f"{prefix}{k}.")
                     for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k))
  return f"{prefix.rstrip('.') or 'value'} {saved!r} -> {current!r}"
