"""The curriculum: a stateless pure function from stage scores to sampling weights.

`weights(candidate, baseline, gate_passed, cfg) -> (pool_mix, stage_weights)` maps the held-out
evaluator's per-stage scores (and the promotion gate's decision) to

- `pool_mix` `[..., 3]`: the share of the round view drawn from the pools `workflow.POOLS`
  (`s_target`, `s_mix`, `e2e`), summing to 1;
- `stage_weights` `[..., 5]`: how the S-target rows spread over stages S1..S5, summing to 1.

Score vectors are `[..., 5]` in S1..S5 order with NaN for a null stage (missing evidence). Null
stages never receive weight. The core is written in `jax.numpy` on arrays of any leading batch
shape, so it can be jitted, vmapped over a sweep of score vectors, and property-tested; the
mode is static (part of `cfg`). Dict forms (`{"S1": 0.7, ...}`, None = null) are accepted at the
edge and come back as dicts of floats, the form the Stage Bank consumes.

Every mode ranks stages by one *key*, lowest first:

- normally the key is the candidate's stage score (the weakest stage is the target);
- when the gate held and some stage regressed (baseline - candidate > 0), the key is minus the
  regression, over the stages scored on both sides (the stage that fell most is the target).

Modes (`MODES`):

- `argmin`: BaT's rule. One-hot at the lowest key; ties go to the earliest stage. Pool mix from
  the config (the reference is 4/2/2 rows per batch of 8, i.e. 0.5/0.25/0.25).
- `softmin`: `softmax(-key / temperature)` over the eligible stages; tends to `argmin` as the
  temperature goes to 0 (tied stages then share the weight). Pool mix from the config.
- `uniform`: equal weight on every scored stage; ignores the scores. Pool mix from the config.
- `e2e_only`: every row from the E2E pool (pool mix 0/0/1); stage weights uniform over the
  scored stages (they select nothing, but stay a distribution).
- `reach_argmin`: BaT's rule with a stage's two causes of a low score told apart. A reported
  score is reach x quality (`reach`: the share of cells whose episode got to the stage; an
  unreached stage scores 0), and S-target practice starts *at* its stage, so it can raise
  quality but not reach. The target is the argmin of quality where reached (score / reach,
  over reached stages); the share of the stage loss `sum(1 - score)` that is reach loss
  `sum(1 - reach)` moves from the configured mix to the E2E pool, whose episodes run from the
  start. With every stage reached everywhere it is `argmin` exactly. Why: after SFT, run m1
  reached S4 in 13 of 42 held-out cells and scored 0.69 there; argmin sent its rounds to S4 and
  S5 practice that cannot fix reach (experiments/README.md, "GRPO's step").

When no stage is scored at all there is nothing to rank; the array core then returns uniform
stage weights over all five stages (jitted code cannot raise).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from bat_jax import workflow
from bat_jax.stagebank.rounds import RoundWeights

NUM_STAGES = len(workflow.STAGES)
NUM_POOLS = len(workflow.POOLS)
# The reference round view: 4 S-target, 2 S-mix and 2 E2E rows in every batch of 8.
REFERENCE_POOL_ROWS: Mapping[str, int] = {"s_target": 4, "s_mix": 2, "e2e": 2}

ArrayLike = Union[jax.Array, np.ndarray]
ScoreDict = Mapping[str, Optional[float]]


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
  """Static curriculum settings (hashable, so it can be a static jit argument).

  Attributes:
    mode: a key of `MODES`.
    temperature: softmin temperature (> 0); only `softmin` reads it.
    pool_mix: relative pool sizes in `workflow.POOLS` order (s_target, s_mix, e2e), e.g. rows
      per batch (4, 2, 2); normalised to sum to 1.
  """

  mode: str = "argmin"
  temperature: float = 0.1
  pool_mix: tuple[float, ...] = tuple(float(REFERENCE_POOL_ROWS[p]) for p in workflow.POOLS)

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"curriculum.mode: unknown mode {self.mode!r}; expected one of "
                       f"{sorted(MODES)}")
    if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
            and self.temperature > 0):
      raise ValueError(f"curriculum.temperature: must be a finite number > 0, got "
                       f"{self.temperature!r}")
    if len(self.pool_mix) != NUM_POOLS:
      raise ValueError(f"curriculum.pool_mix: needs {NUM_POOLS} entries {workflow.POOLS}, got "
                       f"{self.pool_mix!r}")
    for pool, share in zip(workflow.POOLS, self.pool_mix):
      if not (math.isfinite(share) and share >= 0):
        raise ValueError(f"curriculum.pool_mix.{pool}: must be finite and >= 0, got {share!r}")
    if sum(self.pool_mix) <= 0:
      raise ValueError(f"curriculum.pool_mix: must have a positive total, got {self.pool_mix!r}")

  @classmethod
  def from_config(cls, section: Union[ConfigDict, Mapping[str, Any]]) -> "CurriculumConfig":
    """Builds from the `curriculum` config section: `mode`, `temperature`, `pool_mix` dict."""
    values = section.to_dict() if isinstance(section, ConfigDict) else dict(section)
    unknown = set(values) - {"mode", "temperature", "pool_mix"}
    if unknown:
      raise ValueError(f"curriculum: unknown field(s) {sorted(unknown)}")
    mix = dict(values.get("pool_mix", REFERENCE_POOL_ROWS))
    if set(mix) != set(workflow.POOLS):
      raise ValueError(f"curriculum.pool_mix: must have exactly the keys {workflow.POOLS}, got "
                       f"{sorted(mix)}")
    return cls(mode=values.get("mode", cls.mode),
               temperature=float(values.get("temperature", cls.temperature)),
               pool_mix=tuple(float(mix[p]) for p in workflow.POOLS))


class _Ranking(NamedTuple):
  """What every mode sees. All arrays share the leading batch shape `[...]`."""
  key: jax.Array        # [..., 5] lower = more in need of practice; +inf where not eligible
  eligible: jax.Array   # [..., 5] bool: the stages the key ranks
  live: jax.Array       # [..., 5] bool: stages with a candidate score
  score: jax.Array      # [..., 5] the candidate's stage scores (NaN = null)
  reach: jax.Array      # [..., 5] share of cells that reached each stage (1 when not given)
  by_regression: jax.Array  # [..., 1] bool: the key is minus the regression (gate held)


ModeFn = Callable[[_Ranking, CurriculumConfig], tuple[jax.Array, jax.Array]]


def _normalised(mask: jax.Array) -> jax.Array:
  """Uniform weights over `mask` [..., K]; uniform over all K where the mask is empty."""
  m = mask.astype(jnp.float32)
  m = jnp.where(m.sum(-1, keepdims=True) > 0, m, jnp.ones_like(m))
  return m / m.sum(-1, keepdims=True)


def _configured_pool_mix(ranking: _Ranking, cfg: CurriculumConfig) -> jax.Array:
  mix = jnp.asarray(cfg.pool_mix, jnp.float32)
  return jnp.broadcast_to(mix / mix.sum(), ranking.key.shape[:-1] + (NUM_POOLS,))


def _argmin(ranking: _Ranking, cfg: CurriculumConfig) -> tuple[jax.Array, jax.Array]:
  # jnp.argmin returns the first minimum, so ties go to the earliest stage.
  onehot = jax.nn.one_hot(jnp.argmin(ranking.key, axis=-1), NUM_STAGES, dtype=jnp.float32)
  any_eligible = ranking.eligible.any(-1, keepdims=True)
  stage = jnp.where(any_eligible, onehot, _normalised(ranking.eligible))
  return _configured_pool_mix(ranking, cfg), stage


def _softmin(ranking: _Ranking, cfg: CurriculumConfig) -> tuple[jax.Array, jax.Array]:
  key = jnp.where(ranking.eligible, ranking.key, 0.0)
  logits = jnp.where(ranking.eligible, -key / cfg.temperature, -jnp.inf)
  any_eligible = ranking.eligible.any(-1, keepdims=True)
  # An all -inf row would give NaN; it takes the uniform fallback instead.
  safe_logits = jnp.where(any_eligible, logits, 0.0)
  stage = jnp.where(any_eligible, jax.nn.softmax(safe_logits, axis=-1),
                    _normalised(ranking.eligible))
  return _configured_pool_mix(ranking, cfg), stage


def _uniform(ranking: _Ranking, cfg: CurriculumConfig) -> tuple[jax.Array, jax.Array]:
  return _configured_pool_mix(ranking, cfg), _normalised(ranking.live)


def _e2e_only(ranking: _Ranking, cfg: CurriculumConfig) -> tuple[jax.Array, jax.Array]:
  del cfg
  e2e = jnp.asarray([p == "e2e" for p in workflow.POOLS], jnp.float32)
  pool = jnp.broadcast_to(e2e, ranking.key.shape[:-1] + (NUM_POOLS,))
  return pool, _normalised(ranking.live)


def _reach_argmin(ranking: _Ranking, cfg: CurriculumConfig) -> tuple[jax.Array, jax.Array]:
  reached = ranking.eligible & (ranking.reach > 0)
  quality = jnp.minimum(ranking.score / jnp.where(reached, ranking.reach, 1.0), 1.0)
  key = jnp.where(ranking.by_regression, ranking.key, jnp.where(reached, quality, jnp.inf))
  eligible = jnp.where(ranking.by_regression, ranking.eligible, reached)
  mix, stage = _argmin(ranking._replace(key=key, eligible=eligible), cfg)
  # 1 - score = (1 - reach) + reach * (1 - quality), so the reach share lies in [0, 1].
  reach_loss = jnp.where(ranking.live, 1.0 - ranking.reach, 0.0).sum(-1, keepdims=True)
  stage_loss = jnp.where(ranking.live, 1.0 - ranking.score, 0.0).sum(-1, keepdims=True)
  reach_share = jnp.where(stage_loss > 0,
                          jnp.clip(reach_loss / jnp.where(stage_loss > 0, stage_loss, 1.0),
                                   0.0, 1.0), 0.0)
  e2e = jnp.asarray([p == "e2e" for p in workflow.POOLS], jnp.float32)
  return reach_share * e2e + (1.0 - reach_share) * mix, stage


MODES: Mapping[str, ModeFn] = {
    "argmin": _argmin,
    "softmin": _softmin,
    "uniform": _uniform,
    "e2e_only": _e2e_only,
    "reach_argmin": _reach_argmin,
}


def _rank(candidate: jax.Array, baseline: jax.Array, gate_passed: jax.Array,
          reach: jax.Array) -> _Ranking:
  """The key each mode ranks by: candidate score, or minus the regression on a held gate."""
  live = ~jnp.isnan(candidate)
  paired = live & ~jnp.isnan(baseline)
  regression = jnp.where(paired, baseline - candidate, -jnp.inf)
  use_regression = (~gate_passed) & (regression.max(-1) > 0)       # [...]
  use_regression = use_regression[..., None]
  eligible = jnp.where(use_regression, paired, live)
  key = jnp.where(use_regression, -regression, candidate)
  return _Ranking(key=jnp.where(eligible, key, jnp.inf), eligible=eligible, live=live,
                  score=candidate, reach=reach, by_regression=use_regression)


def _check_stage_axis(name: str, x: jax.Array) -> None:
  if x.ndim < 1 or x.shape[-1] != NUM_STAGES:
    raise ValueError(f"{name} must have shape [..., {NUM_STAGES}] (stages {workflow.STAGES}), "
                     f"got shape {tuple(x.shape)}")


def weights_array(candidate: ArrayLike, baseline: Optional[ArrayLike], gate_passed: Any,
                  cfg: CurriculumConfig, reach: Optional[ArrayLike] = None
                  ) -> tuple[jax.Array, jax.Array]:
  """The jittable core.

  Args:
    candidate: `[..., 5]` candidate stage scores, NaN = null.
    baseline: `[..., 5]` baseline stage scores (NaN = null), or None (no baseline yet).
    gate_passed: bool, scalar or `[...]`.
    cfg: static settings.
    reach: `[..., 5]` share of the candidate's cells that reached each stage, in [0, 1], or
      None (every stage reached everywhere); only `reach_argmin` reads it.

  Returns:
    `(pool_mix [..., 3], stage_weights [..., 5])`, float32, each summing to 1 on the last axis.
  """
  cand = jnp.asarray(candidate, jnp.float32)
  _check_stage_axis("candidate_scores", cand)
  base = (jnp.full_like(cand, jnp.nan) if baseline is None
          else jnp.asarray(baseline, jnp.float32))
  _check_stage_axis("baseline_scores", base)
  base = jnp.broadcast_to(base, cand.shape)
  passed = jnp.broadcast_to(jnp.asarray(gate_passed, bool), cand.shape[:-1])
  reached = jnp.ones_like(cand) if reach is None else jnp.asarray(reach, jnp.float32)
  _check_stage_axis("reach", reached)
  reached = jnp.broadcast_to(reached, cand.shape)
  return MODES[cfg.mode](_rank(cand, base, passed, reached), cfg)


def stage_vector(scores: Optional[ScoreDict], name: str = "stage_scores") -> np.ndarray:
  """`{"S1": x, ...}` (None or NaN = null; a missing stage is null) -> `[5]` float array."""
  out = np.full((NUM_STAGES,), np.nan, np.float64)
  if scores is None:
    return out
  for stage, value in scores.items():
    if stage not in workflow.STAGES:
      raise ValueError(f"{name}: unknown stage {stage!r}; expected {workflow.STAGES}")
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
      raise ValueError(f"{name}.{stage} must be a number or None, got {value!r}")
    value = float(value)
    if math.isnan(value):
      continue
    if not 0.0 <= value <= 1.0:
      raise ValueError(f"{name}.{stage} must lie in [0, 1], got {value!r}")
    out[workflow.STAGES.index(stage)] = value
  return out


def weights(candidate_scores: Union[ArrayLike, ScoreDict],
            baseline_scores: Union[ArrayLike, ScoreDict, None],
            gate_passed: Any,
            cfg: CurriculumConfig,
            reach: Union[ArrayLike, ScoreDict, None] = None,
            ) -> Union[RoundWeights, tuple[jax.Array, jax.Array]]:
  """Pool mix and stage weights for the next round.

  Arrays in (`[..., 5]`, NaN = null): `(pool_mix, stage_weights)` arrays out, see
  `weights_array` (jittable, vmappable). Dicts in (`{"S1": 0.7, ..., "S5": None}`, the
  evaluator's `stage_scores`): the `RoundWeights` the outer loop keeps and the Stage Bank
  builds the round with. `baseline_scores` may be None (first round: no baseline). `reach`
  (`reach_fractions` of the candidate's report, or None) is read by `reach_argmin` only.
  """
  if not isinstance(candidate_scores, Mapping):
    return weights_array(candidate_scores, baseline_scores, gate_passed, cfg, reach)
  if baseline_scores is not None and not isinstance(baseline_scores, Mapping):
    raise TypeError("baseline_scores must be a dict like candidate_scores, or None")
  cand = stage_vector(candidate_scores, "candidate_scores")
  base = stage_vector(baseline_scores, "baseline_scores")
  reach_vector = None
  if reach is not None:
    reach_vector = stage_vector(reach, "reach")
    if np.isnan(reach_vector).any():
      raise ValueError(f"reach: needs a share for every stage {workflow.STAGES}, got {reach!r}")
  pool, stage = weights_array(cand, base, bool(gate_passed), cfg, reach_vector)
  return RoundWeights(pool_dict(pool), stage_dict(stage))


def reach_fractions(report: Mapping[str, Any]) -> Optional[dict[str, float]]:
  """`{"S1": share, ...}`: the share of a report's cells whose episode reached each stage (its
  `completion.stage_evidence` / cells); None when the report has no completion counts."""
  completion = report.get("completion")
  if not completion or not completion.get("cells"):
    return None
  cells = completion["cells"]
  return {s: completion["stage_evidence"][s] / cells for s in workflow.STAGES}


def stage_dict(stage_weights: ArrayLike) -> dict[str, float]:
  """`[5]` stage weights -> `{"S1": w, ...}`."""
  values = np.asarray(stage_weights, np.float64).reshape(NUM_STAGES)
  return {s: float(v) for s, v in zip(workflow.STAGES, values)}


def pool_dict(pool_mix: ArrayLike) -> dict[str, float]:
  """`[3]` pool mix -> `{"s_target": p, "s_mix": p, "e2e": p}`."""
  values = np.asarray(pool_mix, np.float64).reshape(NUM_POOLS)
  return {p: float(v) for p, v in zip(workflow.POOLS, values)}
