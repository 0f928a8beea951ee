"""The agent loop with the real sandbox, tasks and rubric; and with the real JAX engine."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax import workflow
from bat_jax.grpo.logprobs import taken_token_logprobs
from bat_jax.rollout.agent_loop import (AgentLoop, RolloutItem, RolloutLimits, Score,
                                        task_environments)
from bat_jax.rollout.engine import SamplingParams
from bat_jax.rollout.jax_engine import JaxEngine
from bat_jax.rollout.replay_engine import ScriptedEngine
from bat_jax.sandbox import SandboxLimits
from bat_jax.train_tasks import FAMILIES, expert_actions
from rollout_fixtures import LONG_ENGINE

LIMITS = SandboxLimits(wall_s=20.0, cpu_s=10)


def e2e_item(track: str, outcome: str, seed: int = 1) -> RolloutItem:
  inst = FAMILIES[track].generate(seed, outcome)
  messages = ({"role": "system", "content": "You are a research agent."},
              {"role": "user", "content": inst.brief})
  return RolloutItem(f"{track}-{outcome}-{seed}", workflow.E2E, "e2e", messages, inst)


def test_expert_script_through_the_loop_earns_the_rubric_reward(chat, tmp_path, require_bwrap):
  it = e2e_item("segmentation", "recovery")
  plan = [a for s in workflow.STAGES for a in expert_actions(it.instance, s)]
  # Continuation 0 replays the expert; continuation 1 stops at once ("do nothing").
  script = lambda s, k: (chat.render_action(plan[k]) if s == 0 and k < len(plan)
                         else "Finished.\n</think>\n\nDone.")
  loop = AgentLoop(ScriptedEngine(chat, script), chat,
                   task_environments(tmp_path / "ws", LIMITS, cache_dir=tmp_path / "cache"),
                   limits=RolloutLimits(max_response_tokens=200_000, max_turn_tokens=20_000),
                   concurrency=1)  # the script keys on the session's order of appearance
  expert, idle = loop.run([it], group_size=2)
  assert expert.finish_reason == "agent_stop" and expert.num_tool_calls == len(plan)
  assert expert.reward >= 0.9, expert.stage_items
  assert set(expert.stage_scores) == set(workflow.STAGES) and expert.task_score is not None
  assert idle.finish_reason == "agent_stop" and idle.num_tool_calls == 0
  assert idle.reward < 0.1


def test_jax_engine_rollout_logprobs_match_the_trainer_across_turns(model, chat, tmp_path,
                                                                    require_bwrap):
  engine = JaxEngine(model, LONG_ENGINE)
  loop = AgentLoop(engine, chat, task_environments(tmp_path / "ws", LIMITS),
                   sampling=SamplingParams(temperature=1.0),
                   limits=RolloutLimits(max_assistant_turns=3, max_turn_tokens=6))
  row = e2e_item("vqa", "success")
  trajs = loop.run([RolloutItem("s", "S1", "s_target", row.messages, row.instance)],
                   group_size=2)
  for t in trajs:
    # A random policy never closes its turn within 6 tokens: every turn is cut, observed, and
    # continued from the cached prefix until the turn limit.
    assert t.finish_reason == "max_turns" and t.num_turns == 3 and t.error is None
    assert sum(t.loss_mask) == t.num_response_tokens == 18
    assert t.stage_scores == {"S1": None} and t.reward == 0.0  # no evidence: null, not zero
    logp, _ = nnx.jit(lambda m, ids: taken_token_logprobs(
        m, ids, valid=jnp.ones_like(ids, bool), chunk_size=256))(
        model, jnp.asarray([t.token_ids], jnp.int32))
    mask = np.array(t.loss_mask, bool)
    np.testing.assert_allclose(np.array(t.sampler_logp)[mask], np.asarray(logp[0])[mask],
                               atol=1e-4)
  assert trajs[0].token_ids != trajs[1].token_ids


class _Echo:
  """A tool-less environment (the random policy's turns are cut, so it never calls one)."""

  def execute(self, language, code):
    raise AssertionError("no tool call expected")

  def score(self):
    return Score(reward=0.0, stage_items={}, stage_scores={}, task_score=None)


def test_sampled_rollouts_do_not_depend_on_the_batching(model, chat):
  """Each turn samples with its own seed (`turn_seed`) and the engine's rows are batch-invariant,
  so trajectories run one at a time, or all at once interleaving in 4-token steps, are the same
  tokens and logprobs: a replayed GRPO step reproduces its rollouts."""
  items = [RolloutItem(f"s{i}", "S2", "s_mix", ({"role": "user", "content": f"Task {i}."},), None)
           for i in range(2)]

  def rollout(concurrency: int, step_tokens, seed: int):
    loop = AgentLoop(JaxEngine(model, LONG_ENGINE), chat, lambda item, g: _Echo(),
                     sampling=SamplingParams(temperature=1.0),
                     limits=RolloutLimits(max_assistant_turns=3, max_turn_tokens=7),
                     concurrency=concurrency, step_tokens=step_tokens)
    return [(t.token_ids, t.sampler_logp) for t in loop.run(items, group_size=2, seed=seed)]

  alone = rollout(1, None, seed=5)
  assert rollout(4, 4, seed=5) == alone
  assert len({tuple(ids) for ids, _ in alone}) == 4  # continuations of a state differ
  assert rollout(4, 4, seed=6) != alone
