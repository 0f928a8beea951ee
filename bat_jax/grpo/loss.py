"""Clipped policy-gradient loss with KL estimators and loss aggregation modes.

Everything is a pure function of arrays. Estimators and aggregations live in small registries
(`KL_ESTIMATORS`, `LOSS_AGGREGATIONS`); config validation reads the registry keys, so adding a mode
here is the only change needed to make it valid everywhere.

The loss is returned as a `(numerator, denominator)` pair whose denominator does not depend on the
parameters. Summing numerators and denominators over micro-batches and dividing once therefore
gives exactly the full-batch loss and gradient, for every aggregation mode.

Statistics are kept as masked sums (`*_sum`), maxima (`*_max`) and a token count so they too merge
exactly across micro-batches; `finalize_stats` turns them into the reported means.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from bat_jax import registry

Array = jax.Array

# ---------------------------------------------------------------------------------------------
# KL estimators: per-token estimates of KL(pi || pi_ref) from taken-token logprobs. [B, T] -> [B, T]
# ---------------------------------------------------------------------------------------------


def kl_k1(logp: Array, ref_logp: Array) -> Array:
  return logp - ref_logp


def kl_k2(logp: Array, ref_logp: Array) -> Array:
  return 0.5 * (logp - ref_logp) ** 2


# verl's stability clamps (core_algos.py): the log-ratio before every `exp`, and the k3 value.
# Both are hard clamps: outside the range the value is constant and the gradient is zero.
LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def kl_k3(logp: Array, ref_logp: Array) -> Array:
  """Schulman's k3 ("low_var_kl" in verl): `exp(d) - d - 1` with `d = ref_logp - logp` clamped
  to +-20 and the value clamped to +-10, so a token far from the reference adds at most 10 and
  no gradient (unclamped, d = 5 gives 142 with gradient -147 per token)."""
  log_ratio = jnp.clip(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1.0, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)


KL_ESTIMATORS: Mapping[str, Callable[[Array, Array], Array]] = {
    "k1": kl_k1, "k2": kl_k2, "k3": kl_k3}

# ---------------------------------------------------------------------------------------------
# Aggregations: (per-token loss [B, T], mask [B, T], norm_length) -> (numerator, denominator).
# Rows whose mask is all zero contribute nothing and are not counted as sequences, except by
# `seq-mean-token-sum-norm`, whose denominator is a constant by design.
# ---------------------------------------------------------------------------------------------


def _nonempty_rows(mask: Array) -> Array:
  return (mask.sum(axis=-1) > 0).astype(jnp.float32)


def agg_token_mean(loss: Array, mask: Array, norm_length: float) -> tuple[Array, Array]:
  del norm_length
  return (loss * mask).sum(), mask.sum()


def agg_seq_mean_token_mean(loss: Array, mask: Array, norm_length: float) -> tuple[Array, Array]:
  del norm_length
  per_seq = (loss * mask).sum(axis=-1) / jnp.maximum(mask.sum(axis=-1), 1.0)
  return per_seq.sum(), _nonempty_rows(mask).sum()


def agg_seq_mean_token_sum(loss: Array, mask: Array, norm_length: float) -> tuple[Array, Array]:
  del norm_length
  return (loss * mask).sum(), _nonempty_rows(mask).sum()


def agg_seq_mean_token_sum_norm(loss: Array, mask: Array,
                                norm_length: float) -> tuple[Array, Array]:
  # Dr. GRPO / verl: token sums over (rows x a configured constant length), never the padded
  # length, so the scale does not jump when a batch lands in another length bucket.
  return (loss * mask).sum(), jnp.asarray(mask.shape[0] * norm_length, jnp.float32)


LOSS_AGGREGATIONS: Mapping[str, Callable[[Array, Array, float], tuple[Array, Array]]] = {
    "token-mean": agg_token_mean,
    "seq-mean-token-mean": agg_seq_mean_token_mean,
    "seq-mean-token-sum": agg_seq_mean_token_sum,
    "seq-mean-token-sum-norm": agg_seq_mean_token_sum_norm,
}


def validate_loss_config(*, kl_estimator: str, loss_agg: str, clip_low: float, clip_high: float,
                         dual_clip: Optional[float], kl_coef: float, tis_cap: Optional[float],
                         norm_length: Optional[float] = None) -> None:
  """Checks static loss options; each error names the field at fault."""
  registry.check_registered("kl_estimator", kl_estimator, KL_ESTIMATORS)
  registry.check_registered("loss_agg", loss_agg, LOSS_AGGREGATIONS)
  if not 0.0 <= clip_low < 1.0:
    raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
  if clip_high < 0.0:
    raise ValueError(f"clip_high must be >= 0, got {clip_high}")
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
  if kl_coef < 0.0:
    raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
  if tis_cap is not None and tis_cap <= 0.0:
    raise ValueError(f"tis_cap must be > 0 (or None), got {tis_cap}")
  if norm_length is not None and norm_length <= 0:
    raise ValueError(f"norm_length must be > 0, got {norm_length}")
  if loss_agg == "seq-mean-token-sum-norm" and norm_length is None:
    raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs norm_length (a constant, e.g. "
                     "the configured max response length)")


def _check_shapes(logp, old_logp, advantages, mask, ref_logp, sampler_logp) -> None:
  if logp.ndim != 2:
    raise ValueError(f"logp must be [B, T], got shape {logp.shape}")
  for name, arr in (("old_logp", old_logp), ("loss_mask", mask), ("ref_logp", ref_logp),
                    ("sampler_logp", sampler_logp)):
    if arr is not None and arr.shape != logp.shape:
      raise ValueError(f"{name} has shape {arr.shape}, expected {logp.shape} like logp")
  if advantages.shape not in (logp.shape[:1], logp.shape):
    raise ValueError(f"advantages has shape {advantages.shape}, expected ({logp.shape[0]},) "
                     f"per sequence or {logp.shape} per token")


def sampler_gap_stats(old_logp: Array, sampler_logp: Array, mask: Array) -> dict[str, Array]:
  """`|old_logp - sampler_logp|` over masked tokens as a mergeable sum and a maximum."""
  gap = jnp.abs(old_logp - sampler_logp)
  return {"sampler_gap_sum": (gap * mask).sum(),
          "sampler_gap_max": jnp.max(jnp.where(mask > 0, gap, 0.0))}


def _clipped_surrogate(log_ratio: Array, adv: Array, *, clip_low: float, clip_high: float,
                       dual_clip: Optional[float]) -> tuple[Array, Array, Array]:
  """verl's `compute_policy_loss_vanilla` per token: `(loss, ratio, was_clipped)`, all [B, T].

  The log-ratio is clamped to +-20 before `exp` (zero gradient outside), then
  `max(-A r, -A clip(r, 1-lo, 1+hi))`, capped at `-A c` for A < 0 when `dual_clip` = c is set.
  """
  ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  per_token = jnp.maximum(unclipped, clipped)
  if dual_clip is not None:
    per_token = jnp.where(adv < 0, jnp.minimum(per_token, -adv * dual_clip), per_token)
  return per_token, ratio, clipped > unclipped


def _surrogate_and_stats(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                         clip_low: float, clip_high: float,
                         dual_clip: Optional[float]) -> tuple[Array, dict[str, Array]]:
  """Per-token clipped surrogate `[B, T]` and its masked sums (clip fraction, ratio, ...)."""
  adv = advantages.astype(jnp.float32)                              # [B] or [B, T]
  adv = adv[:, None] if adv.ndim == 1 else adv                      # [B, 1] or [B, T]
  log_ratio = logp - old_logp                                       # [B, T]
  per_token, ratio, was_clipped = _clipped_surrogate(
      log_ratio, adv, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
  stats = {
      "tokens": mask.sum(),
      "clip_frac_sum": (was_clipped * mask).sum(),
      "approx_kl_sum": (0.5 * log_ratio ** 2 * mask).sum(),
      "ratio_sum": (ratio * mask).sum(),
      "ratio_max": jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)),
  }
  return per_token, stats


def _truncated_is_weight(old_logp: Array, sampler_logp: Array, tis_cap: float, mask: Array,
                         stats: dict[str, Array]) -> Array:
  """Truncated IS for the sampler/trainer mismatch: min(exp(old - sampler), cap), computed as
  exp(min(., log cap)) so it cannot overflow; a constant weight, not a path for gradients.
  Adds its masked sums to `stats`."""
  log_w = jnp.minimum(old_logp - sampler_logp, jnp.log(tis_cap))
  tis = jax.lax.stop_gradient(jnp.exp(log_w))
  stats["tis_weight_sum"] = (tis * mask).sum()
  stats["tis_capped_frac_sum"] = ((old_logp - sampler_logp >= jnp.log(tis_cap)) * mask).sum()
  return tis


def _check_needed_inputs(kl_coef: float, ref_logp: Optional[Array], tis_cap: Optional[float],
                         sampler_logp: Optional[Array]) -> None:
  if kl_coef > 0 and ref_logp is None:
    raise ValueError("kl_coef > 0 needs ref_logp")
  if tis_cap is not None and sampler_logp is None:
    raise ValueError("tis_cap needs sampler_logp (the rollout engine's logprobs)")


def policy_loss_terms(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                      ref_logp: Optional[Array] = None, sampler_logp: Optional[Array] = None,
                      clip_low: float = 0.2, clip_high: float = 0.2,
                      dual_clip: Optional[float] = None, kl_coef: float = 0.0,
                      kl_estimator: str = "k3", loss_agg: str = "seq-mean-token-mean",
                      tis_cap: Optional[float] = None,
                      norm_length: Optional[float] = None,
                      pg_weight: Optional[Array] = None) -> tuple[Array, Array, dict[str, Array]]:
  """PPO/GRPO clipped surrogate loss over taken tokens.

  Per token, as verl's `compute_policy_loss_vanilla`: `max(-A*r, -A*clip(r, 1-clip_low,
  1+clip_high))` with `r = exp(clamp(logp - old_logp, -20, 20))`; for A<0 capped at
  `-A*dual_clip` when set (verl's clip_ratio_c, default 3); times the truncated importance
  weight `min(exp(old_logp - sampler_logp), tis_cap)` when `tis_cap` is set; plus `kl_coef *
  KL(logp, ref_logp)` (never in the reward; k3 clamped as verl's low_var_kl). Then aggregated
  by `loss_agg`.

  Args:
    logp: `[B, T]` current taken-token logprobs (differentiated).
    old_logp: `[B, T]` behaviour-policy logprobs (the trainer's, before this update).
    advantages: `[B]` per-sequence advantages, or `[B, T]` per token (per-stage credit).
    mask: `[B, T]` 1 on tokens that carry loss.
    ref_logp: `[B, T]` frozen reference logprobs; required when `kl_coef > 0`.
    sampler_logp: `[B, T]` the rollout engine's logprobs; required by `tis_cap`, reported as
      `sampler_gap` when given.
    clip_low, clip_high: asymmetric ratio clip range.
    dual_clip: cap (> 1) for negative advantages, or None.
    kl_coef: KL loss coefficient (0 disables KL).
    kl_estimator, loss_agg: keys of `KL_ESTIMATORS` / `LOSS_AGGREGATIONS`.
    tis_cap: truncated importance-sampling cap, or None.
    norm_length: the constant length of `seq-mean-token-sum-norm` (its denominator is
      rows x norm_length); required by that mode, ignored by the others.
    pg_weight: `[B, T]` optional per-token weight >= 0 of the clipped surrogate (no gradient):
      a 0/1 mask keeps high-entropy tokens only, a token probability reweights the advantage
      (`GrpoConfig.pg_prob_weight`); the KL term and the aggregation's denominator still cover
      every `mask` token, so a weight-1 token counts as it would without it.

  Returns:
    `(numerator, denominator, stats)`: the loss is `safe_divide(numerator, denominator)` (0 for
    an all-zero mask; the train step then skips the update), and the pair is what micro-batches
    accumulate. `stats` are masked sums (`finalize_stats` turns them into means): `pg_loss`,
    `clip_frac`, `approx_kl` (0.5 * (logp - old_logp)^2), `ratio`, `ratio_max`, `kl` when KL is
    on, `sampler_gap` / `sampler_gap_max` with sampler logprobs, `tis_weight` /
    `tis_capped_frac` with TIS, `pg_weight` (its mean over `mask` tokens) with a `pg_weight`,
    and the `tokens` / `sequences` counts.
  """
  validate_loss_config(kl_estimator=kl_estimator, loss_agg=loss_agg, clip_low=clip_low,
                       clip_high=clip_high, dual_clip=dual_clip, kl_coef=kl_coef, tis_cap=tis_cap,
                       norm_length=norm_length)
  _check_shapes(logp, old_logp, advantages, mask, ref_logp, sampler_logp)
  if pg_weight is not None and pg_weight.shape != logp.shape:
    raise ValueError(f"pg_weight has shape {pg_weight.shape}, expected {logp.shape} like logp")
  _check_needed_inputs(kl_coef, ref_logp, tis_cap, sampler_logp)
  mask = mask.astype(jnp.float32)
  per_token, stats = _surrogate_and_stats(logp, old_logp, advantages, mask, clip_low=clip_low,
                                          clip_high=clip_high, dual_clip=dual_clip)
  if tis_cap is not None:
    per_token = per_token * _truncated_is_weight(old_logp, sampler_logp, tis_cap, mask, stats)
  if pg_weight is not None:
    pg_weight = jax.lax.stop_gradient(pg_weight.astype(jnp.float32))
    per_token = per_token * pg_weight
    stats["pg_weight_sum"] = (pg_weight * mask).sum()
  stats["pg_loss_sum"] = (per_token * mask).sum()
  if kl_coef > 0:
    kl = KL_ESTIMATORS[kl_estimator](logp, ref_logp)
    per_token = per_token + kl_coef * kl
    stats["kl_sum"] = (kl * mask).sum()
  if sampler_logp is not None:
    stats.update(sampler_gap_stats(old_logp, sampler_logp, mask))
  numerator, denominator = LOSS_AGGREGATIONS[loss_agg](per_token, mask, norm_length)
  stats["sequences"] = _nonempty_rows(mask).sum()
  return numerator, denominator, stats


def merge_stats(a: Mapping[str, Array], b: Mapping[str, Array]) -> dict[str, Array]:
  """Merges two stat dicts: `*_max` by maximum, everything else by sum."""
  return {k: jnp.maximum(a[k], b[k]) if k.endswith("_max") else a[k] + b[k] for k in a}


def finalize_stats(stats: Mapping[str, Array]) -> dict[str, Array]:
  """Masked sums -> per-token means (`x_sum` -> `x`); maxima and counts pass through."""
  tokens = jnp.maximum(stats["tokens"], 1.0)
  out = {}
  for key, value in stats.items():
    if key.endswith("_sum"):
      out[key[:-len("_sum")]] = value / tokens
    else:
      out[key] = value
  return out


def safe_divide(numerator: Array, denominator: Array) -> Array:
  """`numerator / denominator`, 0 where the denominator is 0 (an all-masked batch)."""
  return jnp.where(denominator > 0, numerator / jnp.where(denominator > 0, denominator, 1.0), 0.0)
