"""`reach_argmin`: argmin on quality where reached, the reach share of the loss to E2E practice."""

import math

import jax
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bat_jax import curriculum
from bat_jax.curriculum import CurriculumConfig

REACH = CurriculumConfig(mode="reach_argmin")
ARGMIN = CurriculumConfig(mode="argmin")
E2E = 2   # workflow.POOLS index
MIX = np.array([0.5, 0.25, 0.25])   # the reference 4/2/2


@jax.jit
def _reach(cand, base, gate_passed, reach):
  return curriculum.weights_array(cand, base, gate_passed, REACH, reach)


def run(cand, base, gate_passed, reach):
  pool, stage = _reach(np.asarray(cand, np.float32), np.asarray(base, np.float32),
                       np.asarray(gate_passed), np.asarray(reach, np.float32))
  return np.asarray(pool, np.float64), np.asarray(stage, np.float64)


def reference(cand, base, gate_passed, reach):
  """The rule written out: (target stage index, e2e share)."""
  live = [i for i, c in enumerate(cand) if not math.isnan(c)]
  regress = [(base[i] - cand[i], i) for i in live if not math.isnan(base[i])]
  if not gate_passed and regress and max(r for r, _ in regress) > 0:
    target = max(regress, key=lambda ri: (ri[0], -ri[1]))[1]
  else:
    quality = [(min(cand[i] / reach[i], 1.0), i) for i in live if reach[i] > 0]
    target = min(quality)[1] if quality else None
  reach_loss = sum(1 - reach[i] for i in live)
  stage_loss = sum(1 - cand[i] for i in live)
  share = reach_loss / stage_loss if stage_loss > 0 else 0.0
  return target, share + (1 - share) * MIX[E2E]


# A stage's reach, then its quality where reached, on 1/16 grids (exact in float32); the
# score is their product, as in the evaluator (an unreached stage scores 0).
stage_draw = st.tuples(st.integers(0, 16), st.integers(0, 16), st.booleans())


def _vectors(draws):
  reach = np.array([r / 16 for r, _, _ in draws])
  cand = np.array([np.nan if null else r / 16 * q / 16 for r, q, null in draws])
  return cand, reach


@settings(max_examples=80, deadline=None)
@given(draws=st.lists(stage_draw, min_size=5, max_size=5),
       base=st.lists(st.integers(0, 16).map(lambda k: k / 16), min_size=5, max_size=5),
       gate_passed=st.booleans())
def test_matches_the_rule_written_out(draws, base, gate_passed):
  cand, reach = _vectors(draws)
  target, e2e_share = reference(list(cand), base, gate_passed, list(reach))
  assume(target is not None)
  # Ties in quality (to float32 rounding) make the target ambiguous: keep exact winners only.
  q = sorted(min(cand[i] / reach[i], 1.0) for i in range(5)
             if not math.isnan(cand[i]) and reach[i] > 0)
  assume(len(q) < 2 or q[1] - q[0] > 1e-4 or not gate_passed)
  pool, stage = run(cand, base, gate_passed, reach)
  assert abs(pool.sum() - 1) < 1e-5 and abs(stage.sum() - 1) < 1e-5 and (pool >= 0).all()
  assert int(stage.argmax()) == target and stage.max() == 1.0
  assert pool[E2E] == pytest.approx(e2e_share, abs=1e-5)
  # What is not E2E keeps the configured 2:1 split of S-target and S-mix.
  assert pool[0] == pytest.approx(2 * pool[1], abs=1e-5)


@settings(max_examples=40, deadline=None)
@given(cand=st.lists(st.one_of(st.just(float("nan")), st.integers(0, 64).map(lambda k: k / 64)),
                     min_size=5, max_size=5),
       base=st.lists(st.integers(0, 64).map(lambda k: k / 64), min_size=5, max_size=5),
       gate_passed=st.booleans())
def test_every_stage_reached_everywhere_is_argmin_exactly(cand, base, gate_passed):
  assume(not all(math.isnan(c) for c in cand))
  ours = run(cand, base, gate_passed, np.ones(5))
  theirs = curriculum.weights_array(np.asarray(cand, np.float32), np.asarray(base, np.float32),
                                    gate_passed, ARGMIN)
  np.testing.assert_allclose(ours[0], np.asarray(theirs[0]), atol=1e-7)
  np.testing.assert_array_equal(ours[1], np.asarray(theirs[1]))
  none = curriculum.weights_array(np.asarray(cand, np.float32), np.asarray(base, np.float32),
                                  gate_passed, REACH)   # reach not given: all reached
  np.testing.assert_array_equal(np.asarray(none[1]), ours[1])


def test_run_m1s_sft_policy():
  """experiments/README.md: S4 reached in 13 of 42 cells, 0.69 where reached."""
  scores = {"S1": 0.871, "S2": 0.714, "S3": 0.532, "S4": 0.214, "S5": 0.250}
  evidence = {"S1": 42, "S2": 30, "S3": 30, "S4": 13, "S5": 14}
  report = {"stage_scores": scores,
            "completion": {"cells": 42, "valid": 42, "stage_evidence": evidence}}
  reach = curriculum.reach_fractions(report)
  assert reach == {s: evidence[s] / 42 for s in scores}
  got = curriculum.weights(scores, None, True, REACH, reach=reach)
  assert got.primary_stage == "S4"
  # reach loss 1.929 of a stage loss 2.419: 0.797 of it, + 0.203 x 0.25.
  assert got.pool_mix["e2e"] == pytest.approx(0.848, abs=2e-3)
  assert got.pool_mix["s_target"] == pytest.approx(2 * got.pool_mix["s_mix"])
  plain = curriculum.weights(scores, None, True, ARGMIN, reach=reach)   # argmin ignores it
  assert plain.pool_mix == {"s_target": 0.5, "s_mix": 0.25, "e2e": 0.25}


def test_an_unreached_stage_is_never_the_target():
  scores = {"S1": 0.9, "S2": 0.8, "S3": 0.6, "S4": 0.0, "S5": 0.0}
  reach = {"S1": 1.0, "S2": 1.0, "S3": 1.0, "S4": 0.0, "S5": 0.0}
  got = curriculum.weights(scores, None, True, REACH, reach=reach)
  assert got.primary_stage == "S3"
  assert got.pool_mix["e2e"] == pytest.approx(2 / 2.7 + (1 - 2 / 2.7) * 0.25, abs=1e-5)


def test_reach_is_checked_and_read_from_reports():
  scores = {s: 0.5 for s in ("S1", "S2", "S3", "S4", "S5")}
  with pytest.raises(ValueError, match="reach: needs a share for every stage"):
    curriculum.weights(scores, None, True, REACH, reach={"S1": 1.0})
  with pytest.raises(ValueError, match=r"reach.S2 must lie in \[0, 1\]"):
    curriculum.weights(scores, None, True, REACH, reach={**scores, "S2": 1.5})
  with pytest.raises(ValueError, match="reach must have shape"):
    curriculum.weights_array(np.full(5, 0.5), None, True, REACH, np.ones(4))
  assert curriculum.reach_fractions({"stage_scores": scores}) is None
  with pytest.raises(ValueError, match="curriculum.mode: unknown mode 'reach'"):
    CurriculumConfig(mode="reach")
