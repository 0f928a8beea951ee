"""GrpoRound's batch: infrastructure failures stay out of the signal; sampler logprobs reach
the loss (truncated IS) and `sampler_gap` is logged every step."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bat_jax import workflow
from bat_jax.bicurl import setup
from bat_jax.bicurl.grpo_round import GrpoRound, grpo_config, rollout_batch
from bat_jax.run_config import RunConfig
from bat_jax.grpo import taken_token_logprobs
from bat_jax.rollout import Trajectory
from tests.bicurl.fast_config import fast_config


def _traj(state_id, reward, *, finish="agent_stop", n=6, tokens=None, logprobs=None):
  tokens = list(range(1, n + 1)) if tokens is None else tokens
  return Trajectory(state_id=state_id, focus="S1", pool="s_target", task_id="t", sample_index=0,
                    token_ids=tokens, loss_mask=[0, 0] + [1] * (len(tokens) - 2),
                    sampler_logp=logprobs or [0.0] * len(tokens), prompt_len=2,
                    reward=reward, finish_reason=finish)


def test_errored_and_aborted_rollouts_leave_the_loss_and_the_baselines():
  trajs = [_traj("a", 1.0), _traj("a", 0.0, finish="error"), _traj("a", 0.5),
           _traj("b", 1.0), _traj("b", 0.0, finish="aborted"),
           _traj("c", 0.0), _traj("c", 1.0, finish="context_full")]
  batch, stats = rollout_batch(trajs, max_len=512, cfg=grpo_config(fast_config()), pad_id=0)
  # a: baseline over {1.0, 0.5} only (0.75), not {1.0, 0.0, 0.5}; b: one member left, dropped;
  # c: context_full is the policy's own doing and stays in.
  np.testing.assert_allclose(batch["advantages"], [0.25, 0.0, -0.25, 0.0, 0.0, -0.5, 0.5])
  np.testing.assert_array_equal(batch["loss_mask"].sum(axis=1), [4, 0, 4, 0, 0, 4, 4])
  assert stats["errors"] == 1 and stats["aborted"] == 1
  assert stats["excluded_trajectories"] == 3 and stats["dropped_groups"] == 1
  assert stats["reward_mean"] == pytest.approx(np.mean([1.0, 0.5, 1.0, 0.0, 1.0]))
  assert batch["input_ids"].shape == batch["sampler_logp"].shape == (7, 128)
  np.testing.assert_array_equal(batch["valid"].sum(axis=1), [len(t.token_ids) for t in trajs])


@pytest.mark.slow  # ~35 s of CPU, mostly compiling the step; over a minute on a loaded box
def test_tis_cap_runs_a_grpo_step_and_logs_the_sampler_gap(tmp_path, chat):
  cfg = RunConfig.from_config(fast_config(grpo__tis_cap=2.0, grpo__kl_coef=0.006, grpo__lr=1e-3))
  model = setup.initial_model(cfg)
  ref = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))  # the step donates the start params
  rng = np.random.default_rng(0)
  ids = rng.integers(1, 500, (4, 24)).tolist()
  trainer_logp, _ = taken_token_logprobs(model, jnp.asarray(ids), valid=jnp.ones((4, 24), bool),
                                         temperature=cfg.rollout.sampling.temperature)
  # The sampler's logprobs differ from the trainer's by a known offset per token.
  offset = rng.uniform(-1.5, 1.5, (4, 24)).astype(np.float32)
  sampler = np.asarray(trainer_logp) + offset
  trajs = [_traj(f"s{i // 2}", float(i % 2), tokens=ids[i], logprobs=sampler[i].tolist())
           for i in range(4)]
  grpo = GrpoRound(cfg, 0, model, ref, types.SimpleNamespace(engine=None), chat,
                   tmp_path / "ckpt", tmp_path / "ws")
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  state = grpo.trainer.init_state(grpo.trainer.place(nnx.state(model, nnx.Param)))
  batch, stats = grpo.prepare(trajs, state.params)
  state, metrics = grpo.trainer.step(state, batch)
  record = {**stats, **{k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}}

  mask = np.zeros((4, 24))
  mask[:, 2:] = 1
  assert record["sampler_gap"] == pytest.approx(np.abs(offset)[mask > 0].mean(), rel=1e-4)
  assert record["sampler_gap_max"] == pytest.approx(np.abs(offset)[mask > 0].max(), rel=1e-4)
  want_w = np.minimum(np.exp(-offset), 2.0)[mask > 0]
  assert record["tis_weight"] == pytest.approx(want_w.mean(), rel=1e-4)
  assert 0 < record["tis_capped_frac"] < 1
  assert record["update_applied"] == 1
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0
  after = jax.tree.map(np.asarray, state.params)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                      jax.tree.leaves(after)))


def test_round_start_kl_reference_is_a_copy_of_the_start_policy(tmp_path, chat):
  cfg = RunConfig.from_config(fast_config(grpo__kl_reference="round_start"))
  model = setup.initial_model(cfg)
  sft = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
  sft_grpo = GrpoRound(RunConfig.from_config(fast_config()), 0, model, sft,
                       types.SimpleNamespace(engine=None), chat, tmp_path / "ckpt2",
                       tmp_path / "ws2")
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(sft_grpo.ref_params))
  # The start params on the run's shardings, as the loop loads a policy.
  nnx.update(model, sft_grpo.trainer.place(nnx.state(model, nnx.Param)))
  grpo = GrpoRound(cfg, 0, model, sft, types.SimpleNamespace(engine=None), chat,
                   tmp_path / "ckpt", tmp_path / "ws")
  ref, start = grpo.ref_params, nnx.state(model, nnx.Param)
  start_values = [np.asarray(s) for s in jax.tree.leaves(start)]
  shardings = [s.sharding for s in jax.tree.leaves(start)]
  # The train state is built from the start params and each step donates it: deleting them
  # (what the first update does) must leave the reference intact, on the same shardings.
  for s in jax.tree.leaves(start):
    s.delete()
  for r, sharding, value in zip(jax.tree.leaves(ref), shardings, start_values):
    assert r.sharding == sharding
    np.testing.assert_array_equal(np.asarray(r), value.astype(np.asarray(r).dtype))


def _episode(scores, task, spans, n=20):
  """An E2E trajectory whose assistant turns are `spans` ((start, end, stage)), rest context."""
  mask = [0] * n
  for start, end, _ in spans:
    mask[start:end] = [1] * (end - start)
  return Trajectory(state_id="e", focus="E2E", pool="e2e", task_id="t", sample_index=0,
                    token_ids=list(range(1, n + 1)), loss_mask=mask, sampler_logp=[0.0] * n,
                    prompt_len=2, reward=workflow.e2e_reward(scores, task),
                    stage_scores=scores, task_score=task, finish_reason="agent_stop",
                    turn_spans=list(spans))


def test_stage_credit_gives_each_turn_its_stage_advantage_to_go():
  """`grpo.advantage.credit = "stage"`: a plan turn both samples got right is not pushed by the
  later stages at discount 0; a stop where infer was due answers for S4; stage-local rows keep
  their sequence advantage; at discount 1 the first stage's credit is the outcome advantage."""
  spans = [(2, 4, "S1"), (5, 7, "S2"), (8, 10, "S3")]
  good = _episode({"S1": 1.0, "S2": 1.0, "S3": 1.0, "S4": 1.0, "S5": 1.0}, 1.0,
                  spans + [(11, 13, "S4"), (14, 16, "S5"), (17, 19, None)])
  stopped = _episode({"S1": 1.0, "S2": 1.0, "S3": 0.5, "S4": None, "S5": None}, None,
                     spans + [(11, 13, None)])
  local = [_traj("s", 1.0), _traj("s", 0.0)]
  trajs = [good, stopped] + local
  own = grpo_config(fast_config(grpo__advantage__credit="stage",
                                grpo__advantage__credit_discount=0.0))
  batch, _ = rollout_batch(trajs, max_len=512, cfg=own, pad_id=0)
  adv = batch["advantages"]
  assert adv.shape == batch["input_ids"].shape
  r_good = np.asarray(workflow.e2e_stage_rewards(good.stage_scores, good.task_score))
  r_stop = np.asarray(workflow.e2e_stage_rewards(stopped.stage_scores, None))
  half = (r_good - r_stop) / 2
  np.testing.assert_allclose(adv[0, 2:4], 0.0)                  # S1: both right
  np.testing.assert_allclose(adv[0, 8:10], half[2])             # S3
  np.testing.assert_allclose(adv[1, 11:13], -half[3])           # the stop answers for S4
  np.testing.assert_allclose(adv[0, 17:19], half[4])            # the closing stop after S5
  np.testing.assert_allclose(adv[1, :2], 0.0)                   # the prompt
  np.testing.assert_allclose(adv[2:, 2:6], [[0.5] * 4, [-0.5] * 4])  # stage-local rows
  whole = grpo_config(fast_config(grpo__advantage__credit="stage"))
  to_go, _ = rollout_batch(trajs, max_len=512, cfg=whole, pad_id=0)
  outcome, _ = rollout_batch(trajs, max_len=512, cfg=grpo_config(fast_config()), pad_id=0)
  np.testing.assert_allclose(to_go["advantages"][:, 2], outcome["advantages"], atol=1e-6)
  np.testing.assert_allclose(to_go["advantages"][1, 11], -half[3:].sum(), atol=1e-6)
