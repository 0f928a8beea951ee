"""`RunConfig`: the run config, typed, built once from the ConfigDict a config file gives.

The anchors are verl's `omega_conf_to_dataclass` and MaxText's `types.py`: the config file stays
a ConfigDict (big_vision overrides, `--config.grpo.lr=1e-6`), and the run turns it into typed
objects in one place, so validating is constructing. Sections the code owns a dataclass for are
that dataclass (`sandbox` is `SandboxLimits`, `rollout.limits` is `RolloutLimits`, ...); the
others stay ConfigDict sections, read by attribute as before. Every problem, whether from the
cross-field checks in `bat_jax.config_validation` or from a dataclass refusing a value, is
reported in one `ConfigError`, one line per field.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ml_collections import ConfigDict

from bat_jax import config_validation
from bat_jax.curriculum import CurriculumConfig
from bat_jax.evaluator.cells import Cell
from bat_jax.evaluator.evaluate import EvalSettings
from bat_jax.evaluator.external import ExternalEvaluator
from bat_jax.gate import GateThresholds
from bat_jax.rollout.engine import SamplingParams
from bat_jax.rollout_protocol import RolloutLimits
from bat_jax.sandbox import SandboxLimits


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """`config.rollout`: the engine, its sampling and the per-trajectory limits."""
  engine: str
  sampling: SamplingParams
  limits: RolloutLimits
  max_concurrent_trajectories: int
  stage_end: bool
  jax: ConfigDict
  sglang: ConfigDict


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A validated run config. `source` is the ConfigDict it was built from (recorded in the run
  directory); the other fields are its sections."""
  source: ConfigDict
  seed: int
  model: ConfigDict
  tokenizer: ConfigDict
  pretrain: ConfigDict
  mesh: ConfigDict
  sharding: ConfigDict
  distributed: ConfigDict
  trainer: ConfigDict
  memory: ConfigDict
  sft: ConfigDict
  grpo: ConfigDict
  rollout: RolloutConfig
  sandbox: SandboxLimits
  stagebank: ConfigDict
  workflow: ConfigDict
  evaluator: ConfigDict
  evaluation: EvalSettings               # from `evaluator`, `rollout.limits`, `sandbox`
  external_evaluator: Optional[ExternalEvaluator]  # `evaluator.kind == "external"` only
  curriculum: CurriculumConfig
  gate: GateThresholds
  logging: ConfigDict

  def heldout_cells(self) -> tuple[Cell, ...]:
    """Every held-out cell the run evaluates: the gate's and the held-back ones
    (`evaluator.heldback_cells_per_track`). The leak check's markers and the tiny base's cache
    key are built from all of them: training must see neither set."""
    heldback = self.evaluator.heldback_cells_per_track
    return self.evaluation.cells() + (self.evaluation.heldback(heldback).cells()
                                      if heldback else ())

  @classmethod
  def from_config(cls, cfg: ConfigDict) -> "RunConfig":
    """Checks and types `cfg`.

    Raises:
      ConfigError: listing every invalid field as `config.<path>: <problem>`.
    """
    typed = config_validation.typed_sections(cfg)
    r = cfg.rollout
    rollout = RolloutConfig(
        engine=r.engine, sampling=typed["rollout.sampling"], limits=typed["rollout.limits"],
        max_concurrent_trajectories=r.max_concurrent_trajectories, stage_end=r.stage_end,
        jax=r.jax, sglang=r.sglang)
    plain = {f.name: cfg[f.name] for f in dataclasses.fields(cls)
             if f.name in cfg and isinstance(cfg[f.name], (ConfigDict, int))
             and f.name not in ("rollout", "sandbox", "curriculum", "gate")}
    return cls(source=cfg, **plain, rollout=rollout, sandbox=typed["sandbox"],
               evaluation=typed["evaluator"],
               external_evaluator=typed.get("evaluator.external"),
               curriculum=typed["curriculum"], gate=typed["gate"])
