"""The policy loss (policy_loss_terms) against an independent NumPy reference, for every mode; gradients; invariants."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bat_jax.grpo import (KL_ESTIMATORS, LOSS_AGGREGATIONS, finalize_stats, policy_loss_terms,
                          safe_divide)


NORM_LENGTH = 13.0  # seq-mean-token-sum-norm's constant; deliberately not the padded length


def policy_loss(*args, **kwargs):
  """(loss, per-token means) from the terms, as the GRPO objective combines them."""
  numerator, denominator, stats = policy_loss_terms(*args, **kwargs)
  metrics = finalize_stats(stats)
  metrics["loss_sum"], metrics["loss_denominator"] = numerator, denominator
  return safe_divide(numerator, denominator), metrics


def reference_loss(xp, logp, old_logp, adv, mask, ref_logp, *, clip_low, clip_high, dual_clip,
                   kl_coef, kl_estimator, loss_agg, sampler_logp=None, tis_cap=None,
                   norm_length=NORM_LENGTH):
  """Written case by case (A>=0 / A<0) rather than with the max-of-two form under test."""
  ratio = xp.exp(xp.clip(logp - old_logp, -20.0, 20.0))
  a = adv[:, None]
  pos = -a * xp.minimum(ratio, 1.0 + clip_high)
  neg = -a * xp.maximum(ratio, 1.0 - clip_low)
  if dual_clip is not None:
    neg = xp.minimum(neg, -a * dual_clip)
  per_token = xp.where(a >= 0, pos, neg)
  if tis_cap is not None:
    per_token = per_token * xp.minimum(xp.exp(old_logp - sampler_logp), tis_cap)
  if kl_coef:
    d = logp - ref_logp
    k3 = xp.exp(xp.clip(-d, -20.0, 20.0)) + xp.clip(d, -20.0, 20.0) - 1.0
    kl = {"k1": d, "k2": 0.5 * d * d, "k3": xp.clip(k3, -10.0, 10.0)}[kl_estimator]
    per_token = per_token + kl_coef * kl
  masked = per_token * mask
  b, t = mask.shape
  if loss_agg == "token-mean":
    return masked.sum() / mask.sum()
  rows = [i for i in range(b) if float(mask[i].sum()) > 0]
  if loss_agg == "seq-mean-token-mean":
    return sum(masked[i].sum() / mask[i].sum() for i in rows) / len(rows)
  if loss_agg == "seq-mean-token-sum":
    return sum(masked[i].sum() for i in rows) / len(rows)
  assert loss_agg == "seq-mean-token-sum-norm"
  return masked.sum() / (b * norm_length)


def random_inputs(seed, b=6, t=9):
  rng = np.random.default_rng(seed)
  logp = rng.normal(-1.5, 0.5, (b, t)).astype(np.float32)
  old = (logp + rng.normal(0, 0.4, (b, t))).astype(np.float32)  # ratios well outside the clip
  ref = (logp + rng.normal(0, 0.3, (b, t))).astype(np.float32)
  sampler = (old + rng.normal(0, 0.2, (b, t))).astype(np.float32)
  adv = rng.normal(size=b).astype(np.float32)
  mask = (rng.uniform(size=(b, t)) < 0.7).astype(np.float32)
  mask[0, :] = 0.0  # an empty row: not counted as a sequence
  mask[1, 0] = 1.0
  return logp, old, adv, mask, ref, sampler


CASES = [dict(loss_agg=agg, kl_estimator=kl, kl_coef=kc, dual_clip=dc, tis_cap=tc)
         for agg, kl, kc, dc, tc in itertools.product(
             sorted(LOSS_AGGREGATIONS), sorted(KL_ESTIMATORS), [0.0, 0.1], [None, 3.0],
             [None, 1.5])
         if not (kc == 0.0 and kl != "k3")]  # the estimator only matters when KL is on


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_matches_numpy_reference_and_grad(case):
  logp, old, adv, mask, ref, sampler = random_inputs(hash(str(case)) % 1000)
  kw = dict(clip_low=0.2, clip_high=0.28, norm_length=NORM_LENGTH, **case)
  sampler_arg = sampler if case["tis_cap"] else None
  loss, metrics = policy_loss(logp, old, adv, mask, ref_logp=ref, sampler_logp=sampler_arg, **kw)
  want = reference_loss(np, logp.astype(np.float64), old, adv, mask, ref,
                        sampler_logp=sampler_arg, **kw)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(float(metrics["loss_sum"] / metrics["loss_denominator"]), want,
                             rtol=2e-5, atol=1e-6)
  grad = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, ref_logp=ref,
                                         sampler_logp=sampler_arg, **kw)[0])(jnp.asarray(logp))
  want_grad = jax.grad(lambda lp: reference_loss(jnp, lp, old, adv, mask, ref,
                                                 sampler_logp=sampler_arg, **kw))(
                                                     jnp.asarray(logp))
  np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-4, atol=1e-7)
  assert np.all(np.asarray(grad)[mask == 0] == 0.0)


def test_grad_matches_finite_differences():
  logp, old, adv, mask, ref, _ = random_inputs(7)
  f = lambda lp: policy_loss(lp, old, adv, mask, ref_logp=ref, kl_coef=0.1)[0]
  grad = np.asarray(jax.grad(f)(jnp.asarray(logp)))
  h = 1e-2
  for i, j in [(1, 0), (2, 3), (4, 5), (5, 8)]:
    if mask[i, j] == 0:
      continue
    up, down = logp.copy(), logp.copy()
    up[i, j] += h
    down[i, j] -= h
    fd = (float(f(up)) - float(f(down))) / (2 * h)
    np.testing.assert_allclose(grad[i, j], fd, rtol=2e-2, atol=2e-4)


@pytest.mark.parametrize("loss_agg", sorted(LOSS_AGGREGATIONS))
def test_zero_advantages_give_zero_policy_gradient(loss_agg):
  logp, old, _, mask, _, _ = random_inputs(3)
  grad = jax.grad(lambda lp: policy_loss(lp, old, jnp.zeros(6), mask, loss_agg=loss_agg,
                                         norm_length=NORM_LENGTH)[0])(jnp.asarray(logp))
  assert np.all(np.asarray(grad) == 0.0)


@pytest.mark.parametrize("loss_agg", sorted(LOSS_AGGREGATIONS))
def test_on_policy_no_kl_loss_is_minus_aggregated_advantage(loss_agg):
  logp, _, adv, mask, _, _ = random_inputs(4)
  loss, metrics = policy_loss(logp, logp, adv, mask, loss_agg=loss_agg, norm_length=NORM_LENGTH)
  adv_tokens = np.broadcast_to(adv[:, None], mask.shape)
  # Aggregate the advantage itself with the same mode.
  masked = adv_tokens * mask
  rows = [i for i in range(6) if mask[i].sum() > 0]
  want = {"token-mean": masked.sum() / mask.sum(),
          "seq-mean-token-mean": np.mean([masked[i].sum() / mask[i].sum() for i in rows]),
          "seq-mean-token-sum": np.mean([masked[i].sum() for i in rows]),
          "seq-mean-token-sum-norm": masked.sum() / (6 * NORM_LENGTH)}[loss_agg]
  np.testing.assert_allclose(float(loss), -want, rtol=1e-5, atol=1e-6)
  assert float(metrics["clip_frac"]) == 0.0
  np.testing.assert_allclose(float(metrics["ratio"]), 1.0, rtol=1e-6)


def test_metrics():
  logp, old, adv, mask, ref, sampler = random_inputs(5)
  _, m = policy_loss(logp, old, adv, mask, ref_logp=ref, sampler_logp=sampler, kl_coef=0.1,
                     kl_estimator="k1")
  sel = mask > 0
  ratio = np.exp(logp - old)[sel]
  np.testing.assert_allclose(float(m["ratio"]), ratio.mean(), rtol=1e-5)
  np.testing.assert_allclose(float(m["ratio_max"]), ratio.max(), rtol=1e-5)
  np.testing.assert_allclose(float(m["kl"]), (logp - ref)[sel].mean(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(m["sampler_gap"]), np.abs(old - sampler)[sel].mean(),
                             rtol=1e-5)
  a = np.broadcast_to(adv[:, None], mask.shape)[sel]
  clipped = ((a > 0) & (ratio > 1.2)) | ((a < 0) & (ratio < 0.8))
  np.testing.assert_allclose(float(m["clip_frac"]), clipped.mean(), rtol=1e-6)
  assert float(m["tokens"]) == mask.sum() and float(m["sequences"]) == 5.0


def test_bad_inputs():
  logp, old, adv, mask, ref, _ = random_inputs(6)
  with pytest.raises(ValueError, match="unknown loss_agg 'mean'.*token-mean"):
    policy_loss(logp, old, adv, mask, loss_agg="mean")
  with pytest.raises(ValueError, match="unknown kl_estimator 'k4'.*k1"):
    policy_loss(logp, old, adv, mask, kl_coef=0.1, ref_logp=ref, kl_estimator="k4")
  with pytest.raises(ValueError, match="old_logp has shape \\(6, 8\\)"):
    policy_loss(logp, old[:, :8], adv, mask)
  with pytest.raises(ValueError, match="advantages has shape \\(5,\\)"):
    policy_loss(logp, old, adv[:5], mask)
  with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logp"):
    policy_loss(logp, old, adv, mask, kl_coef=0.1)
  with pytest.raises(ValueError, match="tis_cap needs sampler_logp"):
    policy_loss(logp, old, adv, mask, tis_cap=2.0)
  with pytest.raises(ValueError, match="dual_clip must be > 1"):
    policy_loss(logp, old, adv, mask, dual_clip=0.5)
  with pytest.raises(ValueError, match="seq-mean-token-sum-norm' needs norm_length"):
    policy_loss(logp, old, adv, mask, loss_agg="seq-mean-token-sum-norm")
  # An all-zero mask (eager or under jit) is a documented 0 loss, never NaN.
  assert float(policy_loss(logp, old, adv, np.zeros_like(mask))[0]) == 0.0
  loss = jax.jit(lambda m: policy_loss(logp, old, adv, m)[0])(np.zeros_like(mask))
  assert float(loss) == 0.0


# ---------------------------------------------------------------------------------------------
# verl parity: the clamps, where they sit w.r.t. gradients, and the constant normaliser.
# ---------------------------------------------------------------------------------------------


def _verl_reference(logp, old, adv, mask, ref, *, clip_low, clip_high, clip_ratio_c, kl_coef):
  """verl's compute_policy_loss_vanilla + kl_penalty("low_var_kl") + token-mean, in torch
  (re-written from their formulas), returning the loss and d loss / d logp."""
  torch = pytest.importorskip("torch")
  lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
  old_t, ref_t = torch.tensor(old, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
  a = torch.tensor(adv, dtype=torch.float64)[:, None]
  m = torch.tensor(mask, dtype=torch.float64)
  ratio = torch.exp(torch.clamp(lp - old_t, min=-20.0, max=20.0))
  loss1 = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
  loss2 = torch.min(-a * clip_ratio_c, loss1)
  pg = torch.where(a < 0, loss2, loss1)
  d = torch.clamp(ref_t - lp, min=-20, max=20)
  kl = torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)
  loss = ((pg + kl_coef * kl) * m).sum() / m.sum()
  loss.backward()
  return loss.item(), lp.grad.numpy()


def test_matches_verl_formulas_with_values_and_gradients_at_the_clamps():
  # Tokens chosen on both sides of every clamp: log-ratios +-25 / +-3, ref - logp of 0.5, 5, 10
  # and 25 (k3 = 0.15, 142, 22,015, 7e10 unclamped).
  logp = np.array([[-1.0, -2.0, -30.0, -0.5, -4.0, -1.5]], np.float32).repeat(2, 0)
  old = logp - np.array([[25.0, -25.0, 3.0, -3.0, 0.1, 0.0]], np.float32)
  ref = logp + np.array([[0.5, 5.0, 10.0, 25.0, -3.0, -25.0]], np.float32)
  adv = np.array([1.5, -2.0], np.float32)
  mask = np.ones_like(logp)
  kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1)
  want, want_grad = _verl_reference(logp, old, adv, mask, ref, clip_ratio_c=3.0, **kw)
  f = lambda lp: policy_loss(lp, old, adv, mask, ref_logp=ref, dual_clip=3.0, loss_agg="token-mean",
                             kl_estimator="k3", **kw)[0]
  np.testing.assert_allclose(float(f(logp)), want, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(jax.grad(f)(jnp.asarray(logp))), want_grad, rtol=1e-4,
                             atol=1e-6)


@pytest.mark.parametrize("gap,want", [(5.0, 10.0), (10.0, 10.0), (1.0, np.e - 2.0)])
def test_k3_value_is_clamped_to_10_with_zero_gradient_beyond(gap, want):
  logp = jnp.array([[-8.0]])
  k3 = lambda lp: KL_ESTIMATORS["k3"](lp, lp * 0 + (-8.0 + gap))[0, 0]
  assert float(k3(logp)) == pytest.approx(want, rel=1e-5)
  grad = float(jax.grad(k3)(logp)[0, 0])
  # Unclamped: d/dlogp = 1 - exp(gap): -147.4 at 5, -22,025 at 10.
  assert grad == (0.0 if gap >= 5 else pytest.approx(1.0 - np.exp(gap), rel=1e-5))


def test_huge_log_ratio_stays_finite():
  # logp - old = 100: exp overflows float32 without verl's +-20 clamp (loss inf, NaN grads).
  logp, old = np.full((1, 3), -1.0, np.float32), np.full((1, 3), -101.0, np.float32)
  f = lambda lp: policy_loss(lp, old, np.array([1.0], np.float32), np.ones((1, 3)),
                             clip_high=1e9)[0]
  assert float(f(logp)) == pytest.approx(-np.exp(20.0), rel=1e-5)
  assert np.all(np.asarray(jax.grad(f)(jnp.asarray(logp))) == 0.0)


def test_seq_mean_token_sum_norm_does_not_depend_on_the_padded_length():
  logp, old, adv, mask, ref, _ = random_inputs(11, t=9)
  pad = lambda x, t: np.pad(x, ((0, 0), (0, t - x.shape[1])))
  losses = [float(policy_loss(pad(logp, t), pad(old, t), adv, pad(mask, t),
                              loss_agg="seq-mean-token-sum-norm", norm_length=64.0)[0])
            for t in (9, 128, 256)]
  np.testing.assert_allclose(losses, losses[0], rtol=1e-6)


def test_tis_weight_is_capped_and_never_overflows():
  logp = np.full((1, 3), -1.0, np.float32)
  sampler = np.array([[-1.0, -1.5, -200.0]], np.float32)   # weights 1, e^0.5, inf -> 2
  _, m = policy_loss(logp, logp, np.array([1.0], np.float32), np.ones((1, 3)),
                     sampler_logp=sampler, tis_cap=2.0)
  np.testing.assert_allclose(float(m["tis_weight"]), (1 + np.exp(0.5) + 2.0) / 3, rtol=1e-5)
  assert float(m["tis_capped_frac"]) == pytest.approx(1 / 3)
  assert np.isfinite(float(m["pg_loss"]))


def test_per_token_advantages_match_the_broadcast_sequence_ones_and_each_token_its_own():
  """`[B, T]` advantages (per-stage credit): a row's constant advantage gives the `[B]` loss
  and gradient exactly; a token's own advantage scales only its own gradient."""
  logp, old, adv, mask, ref, _ = random_inputs(5)
  kw = dict(ref_logp=ref, kl_coef=0.1, clip_low=0.2, clip_high=0.3, dual_clip=3.0)
  per_row = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, **kw)[0])(jnp.asarray(logp))
  tokens = np.broadcast_to(adv[:, None], mask.shape).copy()
  per_tok = jax.grad(lambda lp: policy_loss(lp, old, tokens, mask, **kw)[0])(jnp.asarray(logp))
  np.testing.assert_allclose(per_tok, per_row, rtol=1e-6, atol=1e-7)
  tokens[0, :] = 0.0
  only = jax.grad(lambda lp: policy_loss(lp, logp, tokens, mask)[0])(jnp.asarray(logp))
  assert np.all(np.asarray(only)[0] == 0.0) and np.any(np.asarray(only)[1:] != 0.0)
  with pytest.raises(ValueError, match=r"per token"):
    policy_loss(logp, old, tokens[:, :3], mask)


def test_pg_weight_of_zero_drops_the_policy_gradient_of_a_token_but_keeps_its_kl():
  logp, old, adv, mask, ref, _ = random_inputs(3)
  pg_mask = (np.random.default_rng(4).uniform(size=mask.shape) < 0.5).astype(np.float32)
  kw = dict(kl_coef=0.1, kl_estimator="k3", loss_agg="seq-mean-token-mean")

  def grads(pg):
    fn = lambda lp: policy_loss(lp, old, adv, mask, ref_logp=ref, pg_weight=pg, **kw)[0]
    return np.asarray(jax.grad(fn)(jnp.asarray(logp)))

  full, masked = grads(None), grads(pg_mask)
  kl_only = np.asarray(jax.grad(lambda lp: policy_loss(
      lp, old, np.zeros_like(adv), mask, ref_logp=ref, **kw)[0])(jnp.asarray(logp)))
  kept = (pg_mask * mask) > 0
  dropped = (mask > 0) & ~kept
  assert kept.any() and dropped.any()
  np.testing.assert_allclose(masked[kept], full[kept], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(masked[dropped], kl_only[dropped], rtol=1e-5, atol=1e-7)
  assert not np.allclose(full[dropped], kl_only[dropped])   # the PG term was really there
  # The denominator is unchanged (every mask token), and the kept fraction is reported.
  _, metrics = policy_loss(logp, old, adv, mask, ref_logp=ref, pg_weight=pg_mask, **kw)
  np.testing.assert_allclose(metrics["pg_weight"], (pg_mask * mask).sum() / mask.sum(),
                             rtol=1e-6)
  with pytest.raises(ValueError, match="pg_weight has shape"):
    policy_loss(logp, old, adv, mask, pg_weight=pg_mask[:, :-1])
