"""The shared train step: micro-batching, sharding, finite guard, KL reference, remat, AOT.

XLA's CPU compile dominates the run time, so compiled steps are shared through module fixtures.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bat_jax import sharding
from bat_jax.grpo import GrpoConfig, grpo_loss_fn, taken_token_logprobs
from bat_jax.model import CausalLM
from bat_jax.train import (OptimizerConfig, StepConfig, build_step_fn,
                           init_train_state, make_optimizer, make_schedule, make_train_step,
                           memory_report, split_model, step_shardings)
from policy_fixtures import grpo_batch, tiny_model

# eps=1 keeps Adam's first update ~linear in the gradient (eps=1e-8 makes it ~sign(g)), so
# summation-order differences between equivalent steps stay at float rounding size.
OPT = OptimizerConfig(learning_rate=1e-2, eps=1.0, max_grad_norm=1.0)
BATCH = grpo_batch(1)


def make(micro=1, remat="none", **grpo):
  graphdef, params, rest = split_model(tiny_model())
  optimizer = make_optimizer(OPT)
  step_fn = build_step_fn(graphdef, grpo_loss_fn(GrpoConfig(logprob_chunk_size=5, **grpo)),
                          optimizer, StepConfig(num_micro_batches=micro, remat_policy=remat))
  state = init_train_state(params, optimizer, seed=0)
  return step_fn, state, {"rest": rest, "ref_params": None}, optimizer


def assert_same_update(got, want, rtol=1e-5, atol=1e-7):
  (state_a, m_a), (state_b, m_b) = got, want
  np.testing.assert_allclose(m_a["loss"], m_b["loss"], rtol=1e-6)
  np.testing.assert_allclose(m_a["grad_norm"], m_b["grad_norm"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def full_batch_update():
  step_fn, state, frozen, _ = make(micro=1)
  return jax.jit(step_fn)(state, BATCH, frozen)


@pytest.fixture(scope="module")
def micro4():
  step_fn, state, frozen, _ = make(micro=4)
  return jax.jit(step_fn), state, frozen


def test_four_micro_batches_equal_full_batch(full_batch_update, micro4):
  step, state, frozen = micro4
  new_state, metrics = step(state, BATCH, frozen)
  assert_same_update((new_state, metrics), full_batch_update)
  assert float(metrics["tokens"]) == BATCH["loss_mask"].sum()
  assert int(new_state.step) == 1 and int(metrics["update_applied"]) == 1
  changed = [not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(new_state.params), jax.tree.leaves(state.params))]
  assert all(changed)


def test_zero_advantages_give_zero_gradient(micro4):
  step, state, frozen = micro4
  _, metrics = step(state, {**BATCH, "advantages": np.zeros(8, np.float32)}, frozen)
  assert float(metrics["grad_norm"]) == 0.0


def test_finite_guard_skips_update_and_counts(micro4):
  step, state, frozen = micro4
  nan_old = BATCH["old_logp"].copy()
  nan_old[2, 5] = np.nan
  inf_adv = BATCH["advantages"].copy()
  inf_adv[0] = np.inf
  faults = {"nan old_logp": {**BATCH, "old_logp": nan_old},
            "inf advantage": {**BATCH, "advantages": inf_adv},
            "all-zero mask": {**BATCH, "loss_mask": np.zeros_like(BATCH["loss_mask"])}}
  current = state
  for i, (name, batch) in enumerate(faults.items(), start=1):
    new, metrics = step(current, batch, frozen)
    assert int(metrics["update_applied"]) == 0, name
    assert int(new.skipped) == i and int(new.step) == i, name
    for a, b in zip(jax.tree.leaves((new.params, new.opt_state)),
                    jax.tree.leaves((state.params, state.opt_state))):
      np.testing.assert_array_equal(a, b, err_msg=name)
    current = new
  # A good batch afterwards trains again; the counter keeps its value.
  new, metrics = step(current, BATCH, frozen)
  assert int(metrics["update_applied"]) == 1 and int(new.skipped) == 3


def test_sharded_step_on_8_devices_equals_unsharded(full_batch_update):
  assert jax.device_count() == 8
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  step_fn, state, frozen, optimizer = make(micro=2)
  shardings = step_shardings(state, BATCH, frozen, optimizer, mesh)
  state, frozen = jax.device_put((state, frozen), (shardings.state, shardings.frozen))
  new_state, metrics = make_train_step(step_fn, shardings)(state, BATCH, frozen)
  specs = [tuple(x.sharding.spec) for x in jax.tree.leaves(new_state.params)]
  assert any(any(axis is not None for axis in spec) for spec in specs)  # really sharded
  assert all(x.sharding.mesh.devices.size == 8 for x in jax.tree.leaves(new_state.opt_state))
  assert_same_update((new_state, metrics), full_batch_update)


def test_aot_compiled_remat_step_with_donation(full_batch_update):
  step_fn, state, frozen, _ = make(micro=2, remat="full")
  compiled = make_train_step(step_fn, donate=True).lower(state, BATCH, frozen).compile()
  report = memory_report(compiled)
  assert report["argument_size_in_bytes"] > 0 and "temp_size_in_bytes" in report
  assert_same_update(compiled(state, BATCH, frozen), full_batch_update)


def test_reference_model_runs_only_when_kl_is_on(monkeypatch):
  calls = []
  original = CausalLM.hidden_states
  monkeypatch.setattr(CausalLM, "hidden_states",
                      lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
  counts = {}
  given_ref = {**BATCH, "ref_logp": BATCH["old_logp"]}
  for name, kl_coef, batch in [("no kl", 0.0, BATCH), ("kl", 0.1, BATCH),
                               ("kl, given ref_logp", 0.1, given_ref)]:
    step_fn, state, frozen, _ = make(kl_coef=kl_coef)
    frozen["ref_params"] = state.params
    calls.clear()
    jax.jit(step_fn).trace(state, batch, frozen)  # tracing only: no compile needed
    counts[name] = len(calls)
  # One micro-batch: the objective is traced once (grad, no scan and so no eval_shape of its
  # stats); KL adds exactly the reference forward.
  assert counts == {"no kl": 1, "kl": 2, "kl, given ref_logp": 1}


def test_kl_from_frozen_copy_equals_precomputed_ref_logp():
  policy, ref = tiny_model(seed=0), tiny_model(seed=1)
  cfg = GrpoConfig(kl_coef=0.1, logprob_chunk_size=5)
  loss_fn = grpo_loss_fn(cfg)
  ref_logp = taken_token_logprobs(ref, jnp.asarray(BATCH["input_ids"]),
                                  valid=jnp.asarray(BATCH["valid"]), chunk_size=5)[0]

  @jax.jit
  def both(batch, ref_logp):
    from_model = loss_fn(policy, batch, ref)
    precomputed = loss_fn(policy, {**batch, "ref_logp": ref_logp}, None)
    return from_model, precomputed

  (num_a, den_a, st_a), (num_b, den_b, st_b) = both(BATCH, ref_logp)
  np.testing.assert_allclose(num_a / den_a, num_b / den_b, rtol=1e-6)
  np.testing.assert_allclose(st_a["kl_sum"], st_b["kl_sum"], rtol=1e-6)
  assert float(st_a["kl_sum"]) > 0


def test_on_policy_step_equals_a_separate_old_logp_pass():
  """grpo.old_logp = "step": a batch without old_logp takes the update's own logprobs under
  stop_gradient. With one update per rollout batch that is exact: the same update as old_logp
  scored by a separate pass at the same params (ratio 1, clip inactive), one forward less."""
  step_fn, state, frozen, _ = make(micro=2, dual_clip=3.0)
  graphdef, _, rest = split_model(tiny_model())
  old_logp = jax.jit(lambda p: taken_token_logprobs(
      nnx.merge(graphdef, p, rest), jnp.asarray(BATCH["input_ids"]),
      valid=jnp.asarray(BATCH["valid"]), chunk_size=5)[0])(state.params)
  step = jax.jit(step_fn)
  on_policy = {k: v for k, v in BATCH.items() if k != "old_logp"}
  got = step(state, on_policy, frozen)
  want = step(state, {**BATCH, "old_logp": np.asarray(old_logp)}, frozen)
  assert_same_update(got, want)
  metrics = got[1]
  assert float(metrics["ratio"]) == pytest.approx(1.0, abs=1e-6)
  assert float(metrics["clip_frac"]) == 0.0 and int(metrics["update_applied"]) == 1
  # The stale old_logp of the fixture is another update: the test can tell them apart.
  stale = step(state, BATCH, frozen)[1]
  assert abs(float(stale["ratio"]) - 1.0) > 1e-3


def test_bad_batches_name_the_key():
  step_fn, state, frozen, _ = make()
  trace = lambda fn, batch: jax.jit(fn).trace(state, batch, frozen)
  with pytest.raises(ValueError, match="missing keys \\['advantages'\\]"):
    trace(step_fn, {k: v for k, v in BATCH.items() if k != "advantages"})
  with pytest.raises(ValueError, match="batch\\['old_logp'\\] has shape \\(8, 11\\)"):
    trace(step_fn, {**BATCH, "old_logp": BATCH["old_logp"][:, :11]})
  with pytest.raises(ValueError, match="unknown keys \\['rewards'\\]"):
    trace(step_fn, {**BATCH, "rewards": BATCH["advantages"]})
  with pytest.raises(ValueError, match="batch size 8 is not divisible by num_micro_batches=3"):
    trace(make(micro=3)[0], BATCH)
  with pytest.raises(ValueError, match="kl_coef > 0 needs batch\\['ref_logp'\\] or reference"):
    trace(make(kl_coef=0.1)[0], BATCH)
  with pytest.raises(ValueError, match="unknown loss_agg 'sum'"):
    GrpoConfig(loss_agg="sum")
  with pytest.raises(ValueError, match="unknown advantage_mode 'ppo'"):
    GrpoConfig(advantage_mode="ppo")
  with pytest.raises(ValueError, match="unknown remat_policy 'some'.*dots"):
    StepConfig(remat_policy="some")
  with pytest.raises(ValueError, match="unknown schedule 'linear'.*constant.*cosine"):
    make_schedule(OptimizerConfig(schedule="linear"))


def test_schedule_warmup_then_cosine():
  sched = make_schedule(OptimizerConfig(learning_rate=1.0, schedule="cosine", warmup_steps=4,
                                        total_steps=14, end_lr_ratio=0.1))
  np.testing.assert_allclose([sched(s) for s in (0, 2, 4, 9, 14)],
                             [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5, 0.1], rtol=1e-6, atol=1e-7)
  const = make_schedule(OptimizerConfig(learning_rate=0.3, warmup_steps=0))
  assert float(const(0)) == float(const(100)) == pytest.approx(0.3)



def test_pg_min_entropy_trains_only_high_entropy_tokens():
  """grpo.pg_min_entropy: the objective keeps the policy gradient where the policy's entropy
  reaches the threshold. 0 is the release's loss exactly; a threshold above every token's
  entropy leaves only the KL term; one in between keeps a fraction of the tokens."""
  policy, ref = tiny_model(seed=0), tiny_model(seed=1)
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  ref_logp = taken_token_logprobs(ref, batch["input_ids"], valid=batch["valid"], chunk_size=5)[0]
  batch = {**batch, "ref_logp": ref_logp}

  def loss(threshold, advantages=None):
    fn = grpo_loss_fn(GrpoConfig(kl_coef=0.1, logprob_chunk_size=5, compute_entropy=True,
                                 pg_min_entropy=threshold))
    b = batch if advantages is None else {**batch, "advantages": advantages}
    num, den, stats = fn(policy, b, None)
    return float(num / den), {k: float(v) / float(stats["tokens"]) for k, v in stats.items()
                              if k in ("pg_weight_sum", "entropy_sum")}

  release, stats0 = loss(0.0)
  assert "pg_weight_sum" not in stats0
  median = float(np.median(np.asarray(taken_token_logprobs(
      policy, batch["input_ids"], valid=batch["valid"], chunk_size=5, with_entropy=True)[1])[
          np.asarray(batch["loss_mask"]) > 0]))
  _, half = loss(median)
  assert 0.2 < half["pg_weight_sum"] < 0.8
  above_all, none_kept = loss(1e3)
  assert none_kept["pg_weight_sum"] == 0.0
  kl_only, _ = loss(0.0, advantages=jnp.zeros_like(batch["advantages"]))
  np.testing.assert_allclose(above_all, kl_only, rtol=1e-6)
  assert abs(release - kl_only) > 1e-4
  with pytest.raises(ValueError, match="pg_min_entropy"):
    GrpoConfig(pg_min_entropy=-0.1)


def test_pg_prob_weight_one_turns_the_gradient_of_log_p_into_the_gradient_of_p():
  """grpo.pg_prob_weight (advantage reweighting): at 1 each token's policy gradient is
  -A * grad p(token), at 0.5 halfway, at 0 the release's -A * grad log p. No KL; on-policy
  (no old_logp, as the loop's `old_logp = step`)."""
  batch = {k: jnp.asarray(v) for k, v in BATCH.items() if k != "old_logp"}
  mask = batch["loss_mask"].astype(jnp.float32)
  adv = batch["advantages"][:, None]

  def weighted(model, alpha):   # the objective's loss
    num, den, _ = grpo_loss_fn(GrpoConfig(logprob_chunk_size=5, pg_prob_weight=alpha))(
        model, batch, None)
    return num / den

  def by_hand(model, alpha):    # -A * (alpha * p + (1 - alpha) * log p), seq-mean-token-mean
    logp = taken_token_logprobs(model, batch["input_ids"], valid=batch["valid"], chunk_size=5)[0]
    per_token = -adv * (alpha * jnp.exp(logp) + (1 - alpha) * logp)
    return jnp.mean((per_token * mask).sum(1) / mask.sum(1))

  got = {}
  for alpha in (1.0, 0.5):
    got[alpha] = nnx.grad(lambda m: weighted(m, alpha))(tiny_model(seed=0))
    want = nnx.grad(lambda m: by_hand(m, alpha))(tiny_model(seed=0))
    for g, w in zip(jax.tree.leaves(got[alpha]), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=1e-7)
  release = nnx.grad(lambda m: weighted(m, 0.0))(tiny_model(seed=0))
  one = got[1.0]
  assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(release), jax.tree.leaves(one)))
  for bad in (-0.1, 1.5):
    with pytest.raises(ValueError, match="pg_prob_weight"):
      GrpoConfig(pg_prob_weight=bad)
