"""GRPO learns: the loop's own round code raises a trivially learnable reward.

A one-token bandit on the `tiny:smoke` model, random init: each prompt's first sampled token
earns 1 when it lies in a fixed eighth of the vocabulary (about 1/8 of the initial mass), else
0. Everything past the sampling is the loop's: `GrpoRound.prepare` (the batching of
`rollout_batch`, group advantages, with `grpo.old_logp = "pass"` the old-policy logprob pass),
`grpo.trainer.step` (the jitted GRPO loss, clipping, AdamW, finite guard) and the `Trainer.fit`
rule that a step without signal makes no update; both old-logprob sources are run. The mean reward must climb from < 0.3 to > 0.7 within the step budget;
the negative controls (advantages of the opposite sign, the update skipped) must not, so the
test fails if the loop silently stops learning.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bat_jax.bicurl import setup
from bat_jax.bicurl.grpo_round import GrpoRound
from bat_jax.rollout import Trajectory
from bat_jax.rollout.sampling import token_logprobs
from bat_jax.run_config import RunConfig
from tests.bicurl.fast_config import fast_config

STEPS = 16
GROUPS, GROUP_SIZE, PROMPT_LEN = 8, 8, 6
GOOD = (256, 512)  # rewarded first tokens: ids in [256, 512), 1/8 of the 2k smoke vocabulary


def _reward(token: int, flipped: bool) -> float:
  hit = GOOD[0] <= token < GOOD[1]
  return float(hit != flipped)


def _first_tokens(graphdef, params, rest, prompts: jax.Array, key: jax.Array,
                  temperature: float) -> tuple[jax.Array, jax.Array]:
  """One token sampled after each prompt [N, P] by the policy: (tokens [N], logprobs [N])."""
  model = nnx.merge(graphdef, params, rest)
  logits = model(jnp.asarray(prompts))[:, -1]                          # [N, V]
  temp = jnp.full((prompts.shape[0],), temperature, jnp.float32)
  tokens = jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)
  return tokens, token_logprobs(logits, tokens, temp)


_sample = jax.jit(_first_tokens, static_argnums=(0, 5))


def _rollouts(grpo, params, prompts, key, flipped) -> tuple[list[Trajectory], float]:
  """GROUPS x GROUP_SIZE one-token trajectories (group = prompt) and their true hit rate."""
  rows = np.repeat(prompts, GROUP_SIZE, axis=0)
  temperature = float(grpo.cfg.rollout.sampling.temperature)
  tokens, logps = jax.device_get(_sample(grpo.trainer.graphdef, params, grpo.trainer.rest,
                                         rows, key, temperature))
  trajs = [Trajectory(state_id=f"s{i // GROUP_SIZE}", focus="S1", pool="s_target", task_id="t",
                      sample_index=i % GROUP_SIZE, token_ids=[*map(int, row), int(tok)],
                      loss_mask=[0] * PROMPT_LEN + [1],
                      sampler_logp=[0.0] * PROMPT_LEN + [float(lp)], prompt_len=PROMPT_LEN,
                      reward=_reward(int(tok), flipped), finish_reason="agent_stop")
           for i, (row, tok, lp) in enumerate(zip(rows, tokens, logps))]
  hits = np.mean([GOOD[0] <= t < GOOD[1] for t in tokens])
  return trajs, float(hits)


def _train(tmp_path, chat, *, flipped: bool = False, skip_update: bool = False,
           old_logp: str = "step", advantage_mode: str = "grpo",
           pg_prob_weight: float = 0.0) -> list[float]:
  """Per-step hit rates of STEPS GRPO steps run like `Trainer.fit` runs a round's."""
  # The context cap is the batch's padded length (`rollout_batch`): 16, not 128 tokens.
  cfg = RunConfig.from_config(fast_config(grpo__lr=3e-2, grpo__kl_coef=0.0,
                                          grpo__steps_per_round=STEPS, grpo__old_logp=old_logp,
                                          grpo__advantage__mode=advantage_mode,
                                          grpo__pg_prob_weight=pg_prob_weight,
                                          rollout__limits__max_context_tokens=16))
  model = setup.initial_model(cfg)
  grpo = GrpoRound(cfg, 0, model, None, types.SimpleNamespace(engine=None), chat,
                   tmp_path / "ckpt", tmp_path / "ws")
  state = grpo.trainer.init_state(grpo.trainer.place(nnx.state(model, nnx.Param)))
  prompts = np.random.default_rng(0).integers(600, 2000, (GROUPS, PROMPT_LEN))
  key, hit_rates, applied = jax.random.key(0), [], 0
  for _ in range(STEPS):
    key, sub = jax.random.split(key)
    trajs, hits = _rollouts(grpo, state.params, prompts, sub, flipped)
    hit_rates.append(hits)
    batch, _ = grpo.prepare(trajs, state.params)
    if batch is None or skip_update:   # Trainer.fit: no signal, no update
      state = state.replace(step=state.step + 1)
      continue
    state, metrics = grpo.trainer.step(state, batch)
    applied += int(jax.device_get(metrics["update_applied"]))
  if not skip_update:
    assert applied >= STEPS // 2, f"only {applied} of {STEPS} steps applied an update"
  return hit_rates


@pytest.mark.parametrize("old_logp", ["step", "pass"])
def test_grpo_raises_a_learnable_reward(tmp_path, chat, old_logp):
  hits = _train(tmp_path, chat, old_logp=old_logp)
  assert np.mean(hits[:2]) < 0.3, hits
  assert np.mean(hits[-2:]) > 0.7, hits


@pytest.mark.slow  # an ablation's path, off by default (~35 s alone, with its compiles)
def test_grpo_with_advantage_reweighting_still_learns(tmp_path, chat):
  """grpo.pg_prob_weight = 1 (each token's gradient that of its probability) damps the rare
  sampled tokens; the rewarded eighth starts at ~1/8 of the mass and must still be learnt."""
  hits = _train(tmp_path, chat, pg_prob_weight=1.0)
  assert np.mean(hits[:2]) < 0.3, hits
  assert np.mean(hits[-2:]) > 0.7, hits


@pytest.mark.slow  # the positive test already fails on either defect; these show why (~35 s)
@pytest.mark.parametrize("control", ["flipped_advantage", "skipped_update", "placebo"])
def test_grpo_negative_controls_do_not_learn(tmp_path, chat, control):
  """The same run with the reward's sign flipped (so every advantage flips), without the update,
  or with the placebo's advantages (each row credited with a random group member's: the same
  update size, no credit): the hit rate must not climb, so the positive test measures
  learning, not luck."""
  hits = _train(tmp_path, chat, flipped=control == "flipped_advantage",
                skip_update=control == "skipped_update",
                advantage_mode="placebo" if control == "placebo" else "grpo")
  assert np.mean(hits[-2:]) < 0.3, hits
