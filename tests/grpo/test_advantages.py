"""group_advantages against a loop-based NumPy reference."""

import jax
import numpy as np
import pytest

from bat_jax.grpo import ADVANTAGE_ESTIMATORS, group_advantages
from bat_jax.grpo.advantages import valid_group_members


def numpy_advantages(rewards, group_ids, mode, std_normalize, eps=1e-6):
  out = np.zeros_like(rewards, dtype=np.float64)
  for g in np.unique(group_ids):
    idx = np.nonzero(group_ids == g)[0]
    r = rewards[idx].astype(np.float64)
    if len(idx) == 1:
      continue
    if mode == "grpo":
      a = r - r.mean()
      if std_normalize:
        a = a / (r.std(ddof=1) + eps)
    else:
      a = np.array([r[i] - np.delete(r, i).mean() for i in range(len(r))])
    out[idx] = a
  return out


@pytest.mark.parametrize("mode,std_normalize", [("grpo", False), ("grpo", True), ("rloo", False)])
def test_matches_numpy_reference_on_shuffled_groups(mode, std_normalize):
  rng = np.random.default_rng(0)
  # Non-contiguous, arbitrary ids, uneven group sizes including a singleton.
  group_ids = np.array([17, 3, 17, 99, 3, 17, 3, 5, 17, 99, 3, 3])
  rewards = rng.normal(size=group_ids.shape).astype(np.float32)
  got = np.asarray(group_advantages(rewards, group_ids, mode=mode, std_normalize=std_normalize))
  want = numpy_advantages(rewards, group_ids, mode, std_normalize)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert got[group_ids == 5] == 0.0  # the group of one


def test_groups_never_mix():
  # Shifting one group's rewards by a constant must not move any other group's advantages.
  rng = np.random.default_rng(1)
  group_ids = np.array([0, 1, 0, 1, 2, 2, 0, 1])
  rewards = rng.uniform(size=8).astype(np.float32)
  base = np.asarray(group_advantages(rewards, group_ids, std_normalize=True))
  shifted = rewards + 10.0 * (group_ids == 1)
  moved = np.asarray(group_advantages(shifted, group_ids, std_normalize=True))
  np.testing.assert_allclose(base, moved, rtol=1e-4, atol=1e-5)


def test_bad_inputs_name_the_fault():
  with pytest.raises(ValueError, match="unknown advantage mode 'ppo'.*grpo.*rloo"):
    group_advantages(np.zeros(4), np.zeros(4, int), mode="ppo")
  with pytest.raises(ValueError, match="non-finite values at rows \\[2\\]"):
    group_advantages(np.array([0.0, 1.0, np.nan, 1.0]), np.zeros(4, int))
  with pytest.raises(ValueError, match="group_ids"):
    group_advantages(np.zeros(4), np.zeros(3, int))
  with pytest.raises(ValueError, match="std_normalize.*rloo"):
    group_advantages(np.zeros(4), np.zeros(4, int), mode="rloo", std_normalize=True)
  assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "placebo"}


def test_nan_reward_under_jit_stays_in_its_group():
  # Traced rewards cannot raise: the NaN stays inside its own group (other groups are exact) and
  # the train step's finite guard then skips the update.
  rewards = np.array([1.0, np.nan, 0.0, 1.0], np.float32)
  got = np.asarray(jax.jit(group_advantages)(rewards, np.array([0, 0, 1, 1])))
  assert np.all(np.isnan(got[:2]))
  np.testing.assert_allclose(got[2:], [-0.5, 0.5])


@pytest.mark.parametrize("mode", ["grpo", "rloo"])
def test_invalid_rows_are_left_out_of_their_group(mode):
  # Group 0: three valid members and one errored (reward 0, would drag the mean down); group 1:
  # one valid member left (dropped: 0 everywhere); group 2 untouched.
  group_ids = np.array([0, 0, 0, 0, 1, 1, 2, 2])
  rewards = np.array([1.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.2, 0.8], np.float32)
  valid = np.array([True, True, False, True, True, False, True, True])
  got = np.asarray(group_advantages(rewards, group_ids, valid=valid, mode=mode))
  want = np.zeros(8)
  rows = np.nonzero(valid & (group_ids != 1))[0]
  want[rows] = numpy_advantages(rewards[rows], group_ids[rows], mode, False)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert got[2] == 0.0 and got[4] == 0.0 and got[5] == 0.0
  np.testing.assert_array_equal(np.asarray(valid_group_members(group_ids, valid)),
                                [3, 3, 3, 3, 1, 1, 2, 2])


def test_invalid_rows_rewards_are_never_read():
  rewards = np.array([1.0, np.nan, 0.0, np.inf], np.float32)
  got = np.asarray(group_advantages(rewards, np.array([0, 0, 0, 0]),
                                    valid=np.array([True, False, True, False])))
  np.testing.assert_allclose(got, [0.5, 0.0, -0.5, 0.0])
  with pytest.raises(ValueError, match="valid \\(3,\\) must be \\[B\\]"):
    group_advantages(np.zeros(4), np.zeros(4, int), valid=np.ones(3, bool))


def test_placebo_gives_each_group_grpo_advantages_in_a_random_order():
  group_ids = np.array([17, 3, 17, 99, 3, 17, 3, 5, 17, 99, 3, 3])
  rewards = np.random.default_rng(0).normal(size=group_ids.shape).astype(np.float32)
  valid = np.ones(12, bool)
  valid[6] = False                                   # an errored row: 0, out of its group
  placebo = np.asarray(group_advantages(rewards, group_ids, valid=valid, mode="placebo"))
  grpo = np.asarray(group_advantages(rewards, group_ids, valid=valid))
  for g in np.unique(group_ids):   # the same advantages per group: the same update size
    rows = (group_ids == g) & valid
    np.testing.assert_allclose(np.sort(placebo[rows]), np.sort(grpo[rows]), rtol=1e-6,
                               atol=1e-7)
  assert placebo[6] == 0.0 and placebo[7] == 0.0     # errored; the group of one
  assert not np.allclose(placebo, grpo)
  again = np.asarray(jax.jit(group_advantages, static_argnames="mode")(
      rewards, group_ids, valid=valid, mode="placebo"))
  np.testing.assert_allclose(again, placebo, rtol=1e-6, atol=1e-7)   # one draw per batch
  other = np.asarray(group_advantages(rewards, group_ids + 1, valid=valid, mode="placebo"))
  assert not np.allclose(other, placebo)             # the next step's states draw anew


def test_placebo_advantages_carry_no_reward_signal():
  # 4 rollouts per group, 64 groups a batch, 32 batches: GRPO's advantage follows the row's
  # own reward (corr ~0.87 at G=4); the placebo's is as likely to push a good row down as up.
  rng = np.random.default_rng(3)
  corr = {"grpo": [], "placebo": []}
  for step in range(32):
    group_ids = np.repeat(np.arange(64) + 1000 * step, 4)
    rewards = rng.integers(0, 2, size=256).astype(np.float32)
    for mode in corr:
      adv = np.asarray(group_advantages(rewards, group_ids, mode=mode))
      corr[mode].append(np.corrcoef(rewards, adv)[0, 1])
  assert np.mean(corr["grpo"]) > 0.8
  assert abs(np.mean(corr["placebo"])) < 0.05


def test_stage_credit_is_per_stage_grpo_summed_over_the_stages_ahead():
  """Each stage centred within its group on its own; discount 1 gives stage 0 the outcome
  advantage of the summed reward, 0 each stage its own centred reward; groups never mix."""
  from bat_jax.grpo.advantages import stage_credit
  rng = np.random.default_rng(0)
  rewards = rng.uniform(0, 1, (6, 5)).astype(np.float32)
  groups = np.array([0, 0, 0, 7, 7, 7])
  centred = np.stack([np.asarray(group_advantages(rewards[:, s], groups)) for s in range(5)], 1)
  own = np.asarray(stage_credit(rewards, groups, discount=0.0))
  np.testing.assert_allclose(own, centred, atol=1e-6)
  whole = np.asarray(stage_credit(rewards, groups, discount=1.0))
  np.testing.assert_allclose(whole[:, 0], group_advantages(rewards.sum(1), groups), atol=1e-6)
  np.testing.assert_allclose(whole[:, 3], centred[:, 3:].sum(1), atol=1e-6)
  half = np.asarray(stage_credit(rewards, groups, discount=0.5))
  np.testing.assert_allclose(half[:, 2], centred[:, 2] + 0.5 * centred[:, 3]
                             + 0.25 * centred[:, 4], atol=1e-6)
  valid = np.array([True, True, False, True, True, True])
  np.testing.assert_allclose(np.asarray(stage_credit(rewards, groups, valid=valid))[2], 0.0)
  with pytest.raises(ValueError, match="discount 2"):
    stage_credit(rewards, groups, discount=2.0)
