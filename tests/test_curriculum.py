"""Curriculum: the DESIGN.md reference cases, a NumPy reference of BaT's rule, and properties."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bat_jax import curriculum
from bat_jax.curriculum import CurriculumConfig

STAGES = ("S1", "S2", "S3", "S4", "S5")
ARGMIN = CurriculumConfig(mode="argmin")


def _target(cand, base=None, gate_passed=True):
  """The stage an argmin round trains on: the one holding all the stage weight."""
  if isinstance(cand, dict):
    stage = curriculum.weights(cand, base, gate_passed, ARGMIN).stage_weights
    return max(stage, key=stage.get)
  _, stage = curriculum.weights(cand, base, gate_passed, ARGMIN)
  return STAGES[int(np.argmax(np.asarray(stage)))]
SOFTMIN = CurriculumConfig(mode="softmin", temperature=0.1)
ALL_MODES = tuple(CurriculumConfig(mode=m, temperature=0.1) for m in curriculum.MODES)


@functools.lru_cache(maxsize=None)
def jitted(cfg: CurriculumConfig):
  """One compiled function per config, so property tests run compiled code."""
  return jax.jit(lambda c, b, g: curriculum.weights_array(c, b, g, cfg))


def run(cfg, cand, base, gate_passed):
  pool, stage = jitted(cfg)(np.asarray(cand, np.float32), np.asarray(base, np.float32),
                            np.asarray(gate_passed))
  return np.asarray(pool), np.asarray(stage)


def reference_target(cand, base, gate_passed):
  """BaT's target rule written out plainly (bat-reference.json `target_selection`)."""
  if not gate_passed:
    regress = [(b - c, i) for i, (c, b) in enumerate(zip(cand, base))
               if not (math.isnan(c) or math.isnan(b))]
    if regress and max(r for r, _ in regress) > 0:
      best = max(r for r, _ in regress)
      return min(i for r, i in regress if r == best)
  live = [(c, i) for i, c in enumerate(cand) if not math.isnan(c)]
  low = min(c for c, _ in live)
  return min(i for c, i in live if c == low)


# Scores on a 1/64 grid: ties are common, and scores and their differences are exact in both
# float32 (the jitted core) and float64 (the reference), so a tie is a tie on both sides.
# NaN is a null stage.
score = st.one_of(st.just(float("nan")), st.integers(0, 64).map(lambda k: k / 64))
vector = st.lists(score, min_size=5, max_size=5)


# --- The reference cases of DESIGN.md -------------------------------------------------------

def test_reference_case_lowest_stage():
  cand = {"S1": 0.70, "S2": 0.55, "S3": 0.20, "S4": 0.45, "S5": 0.60}
  assert _target(cand, None, True) == "S3"
  w = curriculum.weights(cand, None, True, ARGMIN)
  pool, stage = w.pool_mix, w.stage_weights
  assert stage == {"S1": 0.0, "S2": 0.0, "S3": 1.0, "S4": 0.0, "S5": 0.0}
  assert pool == {"s_target": 0.5, "s_mix": 0.25, "e2e": 0.25}


def test_reference_case_tie_goes_to_earliest():
  cand = {"S1": 0.40, "S2": 0.40, "S3": 0.65, "S4": 0.70, "S5": 0.75}
  assert _target(cand, None, True) == "S1"
  stage = curriculum.weights(cand, None, True, ARGMIN).stage_weights
  assert stage["S1"] == 1.0 and stage["S2"] == 0.0


def test_reference_case_held_gate_targets_largest_regression():
  base = {"S1": 0.60, "S2": 0.50, "S3": 0.50, "S4": 0.60, "S5": 0.70}
  # S4 fell 0.12 and S3 fell 0.04; S3 is still the lowest, so only the hold rule picks S4.
  cand = {"S1": 0.60, "S2": 0.50, "S3": 0.46, "S4": 0.48, "S5": 0.70}
  assert _target(cand, base, gate_passed=False) == "S4"
  assert _target(cand, base, gate_passed=True) == "S3"
  stage = curriculum.weights(cand, base, False, ARGMIN).stage_weights
  assert stage["S4"] == 1.0


def test_held_gate_without_regression_falls_back_to_lowest():
  base = {"S1": 0.5, "S2": 0.5, "S3": 0.3, "S4": 0.5, "S5": 0.5}
  cand = {"S1": 0.6, "S2": 0.5, "S3": 0.35, "S4": 0.5, "S5": 0.9}
  assert _target(cand, base, gate_passed=False) == "S3"


# --- Properties ------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(cand=vector, base=vector, gate_passed=st.booleans())
def test_argmin_matches_reference_rule(cand, base, gate_passed):
  assume(not all(math.isnan(c) for c in cand))
  _, stage = run(ARGMIN, cand, base, gate_passed)
  expected = reference_target(cand, base, gate_passed)
  np.testing.assert_array_equal(stage, np.eye(5, dtype=np.float32)[expected])
  assert _target(np.array(cand), np.array(base), gate_passed) == STAGES[expected]


@settings(max_examples=40, deadline=None)
@given(cand=vector, base=vector, gate_passed=st.booleans())
def test_weights_are_distributions_and_nulls_get_nothing(cand, base, gate_passed):
  live = ~np.isnan(np.array(cand))
  for cfg in ALL_MODES:
    pool, stage = run(cfg, cand, base, gate_passed)
    for w in (pool, stage):
      assert (w >= 0).all(), (cfg.mode, w)
      assert abs(float(w.sum()) - 1.0) < 1e-5, (cfg.mode, w)
    if live.any():
      assert (stage[~live] == 0).all(), (cfg.mode, cand, stage)
    else:  # nothing to rank: the documented uniform fallback
      np.testing.assert_allclose(stage, np.full(5, 0.2), rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(cand=vector, temperature=st.sampled_from([0.01, 0.1, 1.0, 10.0]))  # one compile each
def test_softmin_lower_score_never_gets_less_weight(cand, temperature):
  cfg = CurriculumConfig(mode="softmin", temperature=temperature)
  _, stage = run(cfg, cand, [float("nan")] * 5, True)
  c = np.array(cand)
  for i in range(5):
    for j in range(5):
      if not (np.isnan(c[i]) or np.isnan(c[j])) and c[i] < c[j]:
        assert stage[i] >= stage[j], (cand, temperature, stage)


@settings(max_examples=40, deadline=None)
@given(cand=vector, base=vector)
def test_softmin_on_held_gate_larger_regression_never_gets_less_weight(cand, base):
  c, b = np.array(cand), np.array(base)
  reg = b - c
  assume(np.nanmax(reg, initial=-1.0) > 0)
  _, stage = run(SOFTMIN, cand, base, False)
  assert (stage[np.isnan(reg)] == 0).all()
  for i in range(5):
    for j in range(5):
      if not (np.isnan(reg[i]) or np.isnan(reg[j])) and reg[i] > reg[j]:
        assert stage[i] >= stage[j]


@settings(max_examples=60, deadline=None)
@given(cand=vector, base=vector, gate_passed=st.booleans())
def test_softmin_tends_to_argmin_as_temperature_goes_to_zero(cand, base, gate_passed):
  assume(not all(math.isnan(c) for c in cand))
  cold = CurriculumConfig(mode="softmin", temperature=1e-4)
  _, soft = run(cold, cand, base, gate_passed)
  _, hard = run(ARGMIN, cand, base, gate_passed)
  # On the 1/64 grid the runner-up is >= 1/64 away (exp(-156) = 0 in float32), so only exact
  # ties share the mass; argmin's pick is always one of the tied stages, the earliest.
  winners = soft > 1e-6
  np.testing.assert_allclose(soft[winners], 1.0 / winners.sum(), rtol=1e-5)
  assert winners[int(hard.argmax())]
  assert int(np.argmax(winners)) == int(hard.argmax())
  if winners.sum() == 1:
    np.testing.assert_allclose(soft, hard, atol=1e-6)


def test_jit_and_vmap_over_a_batch_of_score_vectors():
  rng = np.random.default_rng(0)
  cand = rng.uniform(size=(16, 5)).astype(np.float32)
  base = rng.uniform(size=(16, 5)).astype(np.float32)
  cand[rng.uniform(size=cand.shape) < 0.2] = np.nan
  cand[3] = np.nan                                     # one all-null row
  gates = rng.uniform(size=16) < 0.5
  for cfg in ALL_MODES:
    fn = lambda c, b, g, cfg=cfg: curriculum.weights(c, b, g, cfg)
    pool_v, stage_v = jax.jit(jax.vmap(fn))(cand, base, gates)
    pool_b, stage_b = jax.jit(fn)(cand, base, gates)      # native [N, 5] broadcasting
    assert stage_v.shape == (16, 5) and pool_v.shape == (16, 3)
    for n in range(16):
      pool_1, stage_1 = run(cfg, cand[n], base[n], gates[n])
      np.testing.assert_allclose(stage_v[n], stage_1, rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(pool_v[n], pool_1, rtol=1e-6)
    np.testing.assert_allclose(stage_b, stage_v, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(pool_b, pool_v, rtol=1e-6)


def test_numpy_and_jax_inputs_agree():
  cand = np.array([0.3, np.nan, 0.1, 0.5, 0.2])
  base = np.array([0.4, 0.4, 0.4, 0.4, 0.4])
  pool_np, stage_np = curriculum.weights(cand, base, True, SOFTMIN)
  pool_jx, stage_jx = curriculum.weights(jnp.asarray(cand), jnp.asarray(base), True, SOFTMIN)
  np.testing.assert_array_equal(stage_np, stage_jx)
  np.testing.assert_array_equal(pool_np, pool_jx)
  assert stage_np[1] == 0 and stage_np[2] == stage_np.max()


# --- Modes and the dict edge -----------------------------------------------------------------

def test_uniform_and_e2e_only():
  cand = {"S1": 0.1, "S2": None, "S3": 0.9, "S4": 0.5, "S5": 0.5}
  w = curriculum.weights(cand, None, True, CurriculumConfig(mode="uniform"))
  pool, stage = w.pool_mix, w.stage_weights
  assert stage == pytest.approx({"S1": 0.25, "S2": 0.0, "S3": 0.25, "S4": 0.25, "S5": 0.25})
  assert pool == {"s_target": 0.5, "s_mix": 0.25, "e2e": 0.25}
  w = curriculum.weights(cand, None, True, CurriculumConfig(mode="e2e_only"))
  pool, stage = w.pool_mix, w.stage_weights
  assert pool == {"s_target": 0.0, "s_mix": 0.0, "e2e": 1.0}
  assert stage["S2"] == 0.0 and sum(stage.values()) == pytest.approx(1.0)


def test_pool_mix_comes_from_config_rows_per_batch():
  cfg = CurriculumConfig.from_config({"mode": "argmin", "temperature": 0.1,
                                      "pool_mix": {"s_target": 6, "s_mix": 1, "e2e": 1}})
  pool = curriculum.weights({"S1": 0.5}, None, True, cfg).pool_mix
  assert pool == {"s_target": 0.75, "s_mix": 0.125, "e2e": 0.125}


def test_dict_edge_treats_missing_and_nan_stages_as_null():
  w = curriculum.weights({"S2": 0.9, "S4": float("nan"), "S5": 0.3}, None, True, SOFTMIN)
  pool, stage = w.pool_mix, w.stage_weights
  assert set(stage) == set(STAGES) and set(pool) == {"s_target", "s_mix", "e2e"}
  assert stage["S1"] == stage["S3"] == stage["S4"] == 0.0
  assert stage["S5"] > stage["S2"] > 0
  assert all(isinstance(v, float) for v in (*stage.values(), *pool.values()))


@pytest.mark.parametrize("scores, match", [
    ({"S6": 0.5}, "unknown stage 'S6'"),
    ({"S1": 1.5}, r"candidate_scores.S1 must lie in \[0, 1\]"),
    ({"S1": "0.5"}, "candidate_scores.S1 must be a number"),
    ({"S1": True}, "candidate_scores.S1 must be a number"),
])
def test_bad_dict_scores_are_named(scores, match):
  with pytest.raises(ValueError, match=match):
    curriculum.weights(scores, None, True, ARGMIN)


def test_bad_shapes_modes_and_all_null_are_refused():
  with pytest.raises(ValueError, match=r"candidate_scores must have shape \[\.\.\., 5\]"):
    curriculum.weights(np.zeros(4), None, True, ARGMIN)
  with pytest.raises(ValueError, match="curriculum.mode: unknown mode 'argmax'"):
    CurriculumConfig(mode="argmax")
  with pytest.raises(ValueError, match="curriculum.temperature"):
    CurriculumConfig(mode="softmin", temperature=0.0)
  with pytest.raises(ValueError, match="curriculum.pool_mix.s_mix"):
    CurriculumConfig(pool_mix=(4.0, -1.0, 2.0))
  with pytest.raises(ValueError, match="curriculum.pool_mix: must have exactly the keys"):
    CurriculumConfig.from_config({"pool_mix": {"s_target": 4, "mix": 2, "e2e": 2}})


def test_dict_output_is_the_stage_banks_round_weights():
  from bat_jax.stagebank.rounds import RoundWeights
  cand = {"S1": 0.7, "S2": None, "S3": 0.2, "S4": 0.45, "S5": 0.6}
  for cfg in ALL_MODES:
    w = curriculum.weights(cand, None, True, cfg)
    assert isinstance(w, RoundWeights) and w.stage_weights["S2"] == 0.0
    assert RoundWeights.from_json(w.to_json()) == w  # the outer loop's state round-trips
