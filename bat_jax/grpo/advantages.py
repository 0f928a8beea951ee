"""Group-relative advantage estimators (GRPO, RLOO).

Advantages are computed per group: every continuation of one `state_id` shares a group id, and a
reward is only ever compared with the rewards of its own group. Group ids are arbitrary integers
and need not be contiguous in the batch, so groups are resolved with a `[B, B]` same-group matrix
(B is a few dozen rollouts per update, so this is cheap and needs no segment bookkeeping).

Rows marked invalid (an errored or aborted rollout: infrastructure, not the policy) take no part
in any group statistic and get advantage 0; a group with fewer than 2 valid members gets 0 for
every row (`valid_group_members` tells the caller which groups to drop from the loss).
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from bat_jax import registry

AdvantageFn = Callable[..., jax.Array]


def _group_stats(rewards: jax.Array, group_ids: jax.Array,
                 valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-row valid-member count, group sum and same-group matrix.

  Args:
    rewards: `[B]` float rewards.
    group_ids: `[B]` integer group ids.
    valid: `[B]` bool; invalid rows are left out of every group.

  Returns:
    `(count [B], total [B], same [B, B])`, where `same[i, j]` is True when rows i and j share a
    group and row j is valid.
  """
  same = (group_ids[:, None] == group_ids[None, :]) & valid[None, :]
  count = same.sum(axis=1).astype(rewards.dtype)
  return count, _group_sum(same, rewards), same


def _group_sum(same: jax.Array, values: jax.Array) -> jax.Array:
  """`[B]` sum of `values` over each row's group; a `where`, not a matmul, so that a NaN in one
  group cannot leak into the others through `0 * NaN`."""
  return jnp.where(same, values[None, :], 0.0).sum(axis=1)


def grpo_advantages(rewards: jax.Array, group_ids: jax.Array, valid: jax.Array, *,
                    std_normalize: bool = False, eps: float = 1e-6) -> jax.Array:
  """GRPO: `r - mean_g`, optionally divided by `(std_g + eps)` with the sample std (ddof=1)."""
  count, total, same = _group_stats(rewards, group_ids, valid)
  centred = rewards - total / count
  if std_normalize:
    sq = _group_sum(same, rewards ** 2)
    # Sample variance from sums: (sum r^2 - n * mean^2) / (n - 1); groups of one are zeroed below.
    var = (sq - total ** 2 / count) / jnp.maximum(count - 1.0, 1.0)
    centred = centred / (jnp.sqrt(jnp.maximum(var, 0.0)) + eps)
  return jnp.where(valid & (count > 1), centred, 0.0)


def rloo_advantages(rewards: jax.Array, group_ids: jax.Array, valid: jax.Array, *,
                    std_normalize: bool = False, eps: float = 1e-6) -> jax.Array:
  """RLOO: `r_i` minus the mean of the other members of its group (no std normalisation)."""
  del eps
  if std_normalize:
    raise ValueError("std_normalize is not defined for advantage mode 'rloo'")
  count, total, _ = _group_stats(rewards, group_ids, valid)
  loo_mean = (total - rewards) / jnp.maximum(count - 1.0, 1.0)
  return jnp.where(valid & (count > 1), rewards - loo_mean, 0.0)


PLACEBO_SEED = 20261207


def placebo_advantages(rewards: jax.Array, group_ids: jax.Array, valid: jax.Array, *,
                       std_normalize: bool = False, eps: float = 1e-6) -> jax.Array:
  """A control, not an estimator: GRPO's advantages of the rewards shuffled within each group.

  Each group keeps its rewards (so its mean, spread and every update's size are GRPO's), but a
  row's advantage belongs to a uniformly random member of its group, drawn afresh for every
  batch (the key folds in the batch's group ids: each step draws its own states). What a round
  gains over this placebo is what its reward taught; what both lose is what any update of that
  size costs (experiments/README.md, "A placebo round")."""
  key = jax.random.fold_in(jax.random.PRNGKey(PLACEBO_SEED),
                           jnp.sum(group_ids.astype(jnp.uint32)))
  draw = jax.random.uniform(key, rewards.shape)                                # [B]
  row = jnp.arange(rewards.shape[0])
  same = (group_ids[:, None] == group_ids[None, :]) & valid[None, :] & valid[:, None]   # [B, B]
  rank_draw = (same & (draw[None, :] < draw[:, None])).sum(axis=1)   # [B] rank in the group
  rank_row = (same & (row[None, :] < row[:, None])).sum(axis=1)      # [B] position in it
  takes = same & (rank_row[None, :] == rank_draw[:, None])           # row i takes row j's reward
  shuffled = jnp.where(valid, jnp.where(takes, rewards[None, :], 0.0).sum(axis=1), rewards)
  return grpo_advantages(shuffled, group_ids, valid, std_normalize=std_normalize, eps=eps)


ADVANTAGE_ESTIMATORS: Mapping[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "placebo": placebo_advantages,
}


CREDIT_MODES = ("outcome", "stage")


def stage_credit(stage_rewards, group_ids, *, valid=None, discount: float = 1.0,
                 mode: str = "grpo", std_normalize: bool = False) -> jax.Array:
  """Per-stage advantages-to-go of staged episodes: process-reward GRPO over stages.

  Each stage's reward is made group-relative on its own (`group_advantages` per column), and a
  turn of stage s is credited with the discounted sum of those from s on:
  `A[b, s] = sum_{s' >= s} discount ** (s' - s) * centred[b, s']`. With `discount` 1 and rewards
  that sum to the outcome reward, stage 0's credit is the outcome advantage (DeepSeekMath's
  process-supervised GRPO, stages as steps); with 0 a turn answers for its own stage only, so
  a plan call every sample got right is not pushed up or down by what a later stage did.

  Args:
    stage_rewards: `[B, S]` each row's reward earned per stage, in stage order.
    group_ids: `[B]` integer group ids.
    valid: `[B]` bool (default all True), as in `group_advantages`.
    discount: in [0, 1].
    mode, std_normalize: as in `group_advantages`, applied to each stage's column.

  Returns:
    `[B, S]` float32 advantages-to-go; rows without a baseline get 0.
  """
  if not 0.0 <= discount <= 1.0:
    raise ValueError(f"credit discount {discount} is outside [0, 1]")
  stage_rewards = jnp.asarray(stage_rewards, jnp.float32)
  if stage_rewards.ndim != 2:
    raise ValueError(f"stage_rewards must be [B, S], got shape {stage_rewards.shape}")
  centred = jnp.stack([group_advantages(stage_rewards[:, s], group_ids, valid=valid, mode=mode,
                                        std_normalize=std_normalize)
                       for s in range(stage_rewards.shape[1])], axis=1)      # [B, S]
  n = stage_rewards.shape[1]
  ahead = jnp.arange(n)[None, :] - jnp.arange(n)[:, None]                     # [S, S']: s' - s
  weights = jnp.where(ahead >= 0, jnp.float32(discount) ** jnp.maximum(ahead, 0), 0.0)
  return centred @ weights.T


def valid_group_members(group_ids, valid) -> jax.Array:
  """`[B]` number of valid rows in each row's group (a group below 2 carries no signal)."""
  group_ids, valid = jnp.asarray(group_ids), jnp.asarray(valid, bool)
  return ((group_ids[:, None] == group_ids[None, :]) & valid[None, :]).sum(axis=1)


def group_advantages(rewards, group_ids, *, valid=None, mode: str = "grpo",
                     std_normalize: bool = False, eps: float = 1e-6) -> jax.Array:
  """Group-relative advantages; never normalised across groups.

  Args:
    rewards: `[B]` rewards. NaN/inf rewards raise (they would silently poison every group member)
      when the values are concrete; under `jit` they propagate and the train step's finite guard
      skips the update.
    group_ids: `[B]` integer group ids (e.g. a hash of `state_id`), any order.
    valid: `[B]` bool, default all True; invalid rows (errored / aborted rollouts) are left out
      of their group's statistics and get 0. Their rewards are never read (NaN is fine).
    mode: a key of `ADVANTAGE_ESTIMATORS`.
    std_normalize: divide by the group's sample std (ddof=1) + eps (grpo only).
    eps: std floor.

  Returns:
    `[B]` float32 advantages; a group with fewer than 2 valid members gets 0.
  """
  registry.check_registered("advantage mode", mode, ADVANTAGE_ESTIMATORS)
  rewards = jnp.asarray(rewards, jnp.float32)
  group_ids = jnp.asarray(group_ids)
  if rewards.ndim != 1 or group_ids.shape != rewards.shape:
    raise ValueError(f"rewards {rewards.shape} and group_ids {group_ids.shape} must both be [B]")
  valid = jnp.ones(rewards.shape, bool) if valid is None else jnp.asarray(valid, bool)
  if valid.shape != rewards.shape:
    raise ValueError(f"valid {valid.shape} must be [B] like rewards {rewards.shape}")
  rewards = jnp.where(valid, rewards, 0.0)  # an invalid row's reward is never read
  if not isinstance(rewards, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(rewards))):
    bad = [int(i) for i in jnp.nonzero(~jnp.isfinite(rewards))[0]]
    raise ValueError(f"rewards contain non-finite values at rows {bad}")
  return ADVANTAGE_ESTIMATORS[mode](rewards, group_ids, valid, std_normalize=std_normalize,
                                    eps=eps)
