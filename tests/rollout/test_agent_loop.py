"""The agent loop: token-in/token-out masks, malformed output, limits, failure isolation."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from bat_jax import workflow
from bat_jax.rollout.agent_loop import (AgentLoop, PolicyAgent, RolloutItem, RolloutLimits,
                                        Score)
from bat_jax.rollout.replay_engine import ScriptedEngine
from bat_jax.rollout.trajectory import collate

MESSAGES = ({"role": "system", "content": "You are a research agent."},
            {"role": "user", "content": "Plan the segmentation task."})


def final(text: str) -> str:
  """A closing turn with no tool call (the generation prompt opened a <think> block)."""
  return f"Finished.\n</think>\n\n{text}"


def action(code: str, thought: str = "Next step.", language: str = "python") -> dict:
  return {"name": workflow.TOOL_NAME, "arguments": {"language": language, "code": code},
          "thought": thought}


class FakeEnv:
  """Records tool calls; observation and reward depend on what ran."""

  def __init__(self, fail_execute: bool = False):
    self.calls: list[tuple[str, str]] = []
    self.fail_execute = fail_execute

  def execute(self, language: str, code: str) -> str:
    if self.fail_execute:
      raise RuntimeError("bwrap vanished")
    self.calls.append((language, code))
    return workflow.format_observation(0, f"ran {len(self.calls)}", "")

  def score(self) -> Score:
    return Score(reward=len(self.calls) / 10, stage_items={"S1": {"plan_written": True}},
                 stage_scores={"S1": 1.0}, task_score=None, failed_calls=len(self.calls) - 1)


def make_loop(chat, script, *, limits=RolloutLimits(), fail_engine=frozenset(), env_errors=()):
  envs: dict[int, FakeEnv] = {}

  def make_env(item, g):
    if ("setup", g) in env_errors:
      raise OSError("disk full")
    envs[g] = FakeEnv(fail_execute=("execute", g) in env_errors)
    return envs[g]
  engine = ScriptedEngine(chat, script, fail=fail_engine)
  return AgentLoop(engine, chat, make_env, limits=limits, concurrency=1), engine, envs


def item(state_id: str = "state-a") -> RolloutItem:
  return RolloutItem(state_id=state_id, focus="S1", pool="s_target", messages=MESSAGES,
                     instance=None)


def test_scripted_conversation_tokens_and_mask_follow_the_chat_template(chat):
  actions = [action("print('hello')", "Look around."), action("ls -la", "List.", "bash")]
  script = lambda s, k: chat.render_action(actions[k]) if k < 2 else final("The plan is written.")
  loop, engine, envs = make_loop(chat, script)
  [traj] = loop.run([item()], group_size=1)

  assert traj.finish_reason == "agent_stop" and traj.error is None
  assert (traj.num_turns, traj.num_tool_calls, traj.num_malformed) == (3, 2, 0)
  assert envs[0].calls == [("python", "print('hello')"), ("bash", "ls -la")]
  assert traj.reward == pytest.approx(0.2) and traj.stage_scores == {"S1": 1.0}
  assert traj.num_failed_calls == 1  # the environment's count, carried to the trajectory
  # The whole sequence is what the chat template renders for the conversation...
  conversation = list(MESSAGES)
  for k, a in enumerate(actions):
    conversation += [{"role": "assistant", "action": a},
                     {"role": "tool", "content": workflow.format_observation(0, f"ran {k + 1}",
                                                                             "")}]
  conversation.append({"role": "assistant", "content": "The plan is written.",
                       "reasoning_content": "Finished."})
  rendered = chat.encode(chat.render_messages(conversation, add_generation_prompt=False))
  assert traj.token_ids == rendered[:len(traj.token_ids)]
  assert traj.token_ids[-1] == chat.im_end_id
  # ...the mask is 1 exactly on the engine's tokens, with their logprobs, in order...
  generated = [t for turn in engine.outputs[0] for t in turn]
  mask = np.array(traj.loss_mask, bool)
  assert list(np.array(traj.token_ids)[mask]) == generated
  logps = np.array(traj.sampler_logp)
  np.testing.assert_allclose(logps[mask], -0.001 * np.arange(1, len(generated) + 1))
  assert not logps[~mask].any()
  # ...in one contiguous run per assistant turn, each right after the generation prompt.
  starts = np.flatnonzero(np.diff(np.r_[0, mask.astype(int)]) == 1)
  assert len(starts) == 3
  gen_prompt = chat.encode(chat.generation_prompt)
  for s in starts:
    assert traj.token_ids[s - len(gen_prompt):s] == gen_prompt
  assert traj.prompt_len == starts[0]
  assert engine.released and all(r.startswith("state-a/0/") for r in engine.released)


def test_malformed_output_becomes_an_observation_and_the_rollout_goes_on(chat):
  turns = [
      "<tool_call>\n<function=execute_code>\n<parameter=language>\npython\n",  # unclosed
      chat.render_action({**action("x"), "name": "launch_rockets"}),          # unknown tool
      (chat.render_action(action("print(1)")), "length"),                     # cut turn
      chat.render_action(action("y" * 300)),                                  # over-long code
      chat.render_action(action("print('ok')")),
      final("Done."),
  ]
  limits = RolloutLimits(max_code_chars=100)
  loop, _, envs = make_loop(chat, lambda s, k: turns[k], limits=limits)
  [traj] = loop.run([item()], group_size=1)
  assert traj.finish_reason == "agent_stop" and traj.num_turns == 6
  assert traj.num_malformed == 3
  assert envs[0].calls == [("python", "print('ok')")]
  context = chat.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if not m])
  assert "error: malformed tool call" in context
  assert "unknown function 'launch_rockets'" in context
  assert "the turn was cut at" in context
  assert "code is 300 characters, over the 100-character limit" in context


@pytest.mark.parametrize("limits, reason, turns, calls", [
    (RolloutLimits(max_tool_calls=2), "max_tool_calls", 3, 2),
    (RolloutLimits(max_assistant_turns=2), "max_turns", 2, 2),
    (RolloutLimits(max_response_tokens=60, max_turn_tokens=40), "max_response_tokens", None, None),
])
def test_limits_end_the_trajectory_with_their_reason(chat, limits, reason, turns, calls):
  script = lambda s, k: chat.render_action(action(f"print({k})"))
  loop, _, envs = make_loop(chat, script, limits=limits)
  [traj] = loop.run([item()], group_size=1)
  assert traj.finish_reason == reason
  if turns is not None:
    assert traj.num_turns == turns and traj.num_tool_calls == calls
    assert len(envs[0].calls) == calls
  else:
    assert traj.num_response_tokens >= 60
    assert sum(traj.loss_mask) == traj.num_response_tokens


def test_observations_are_clipped_to_the_limit(chat):
  class Loud(FakeEnv):
    def execute(self, language, code):
      return "x" * 5000
  script = lambda s, k: chat.render_action(action("print(1)")) if k == 0 else final("Done.")
  loop = AgentLoop(ScriptedEngine(chat, script), chat, lambda it, g: Loud(),
                   limits=RolloutLimits(max_observation_chars=300))
  [traj] = loop.run([item()], group_size=1)
  context = chat.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if not m])
  assert "x" * 250 in context and "x" * 301 not in context
  assert "[truncated" in context


def test_one_failing_rollout_never_crashes_the_batch(chat):
  script = lambda s, k: chat.render_action(action(f"print({k})")) if k < 2 else final("Done.")
  # g=1: environment setup fails; g=2: the sandbox dies mid-call; session 3 (g=4): engine error.
  loop, _, _ = make_loop(chat, script, fail_engine=frozenset({3}),
                         env_errors={("setup", 1), ("execute", 2)})
  trajs = loop.run([item()], group_size=5)
  reasons = [t.finish_reason for t in trajs]
  assert reasons == ["agent_stop", "error", "error", "agent_stop", "error"]
  assert "environment setup failed: OSError: disk full" in trajs[1].error
  assert "sandbox failed: RuntimeError: bwrap vanished" in trajs[2].error
  assert "engine failed" in trajs[4].error
  assert [t.reward for t in trajs] == [pytest.approx(0.2), 0.0, 0.0, pytest.approx(0.2), 0.0]
  assert [t.sample_index for t in trajs] == [0, 1, 2, 3, 4]


def test_groups_and_collation(chat):
  script = lambda s, k: final("Done.") if k else chat.render_action(action(f"print({s})"))
  loop, _, _ = make_loop(chat, script)
  trajs = loop.run([item("a"), item("b")], group_size=3)
  assert [t.state_id for t in trajs] == ["a"] * 3 + ["b"] * 3
  batch = collate(trajs)
  n = max(len(t.token_ids) for t in trajs)
  assert batch["input_ids"].shape == (6, n) and batch["loss_mask"].shape == (6, n)
  assert list(batch["group_ids"]) == [0, 0, 0, 1, 1, 1]
  for i, t in enumerate(trajs):
    assert batch["loss_mask"][i].sum() == sum(t.loss_mask)
    assert batch["sampler_logp"][i, :len(t.token_ids)] == pytest.approx(t.sampler_logp)
    assert not batch["loss_mask"][i, len(t.token_ids):].any()


def test_an_items_first_continuation_is_set_up_before_its_others(chat):
  # The first one runs the expert's earlier stages and caches the boundary; started together,
  # all G would run them (4x the setup of every row).
  events: list[tuple[str, str, int]] = []

  def make_env(item, g):
    events.append(("begin", item.state_id, g))
    time.sleep(0.05)  # long enough for concurrently started siblings to begin meanwhile
    env = FakeEnv()
    events.append(("end", item.state_id, g))
    return env
  script = lambda s, k: final("Done.")
  loop = AgentLoop(ScriptedEngine(chat, script), chat, make_env, concurrency=4)
  trajs = loop.run([item("a"), item("b")], group_size=3)
  assert [(t.state_id, t.sample_index) for t in trajs] == [
      ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
  for state_id in ("a", "b"):
    first_done = events.index(("end", state_id, 0))
    assert all(events.index(("begin", state_id, g)) > first_done for g in (1, 2))


def test_policy_agent_answers_the_evaluator_protocol(chat):
  a = action("print(42)", "Compute.")
  answers = [chat.render_action(a), final("All done."), "x\n</think>\n\n<tool_call>\n{oops"]
  agent = PolicyAgent(ScriptedEngine(chat, lambda s, k: answers[k]), chat)
  turn = agent(list(MESSAGES))
  assert not turn.stop and turn.actions[0]["arguments"] == a["arguments"]
  done = agent(list(MESSAGES) + [{"role": "assistant", "action": a},
                                 {"role": "tool", "content": "exit_code=0"}])
  assert done.stop and not done.actions and "All done." in done.thought
  bad = agent(list(MESSAGES))
  assert bad.error and not bad.stop and not bad.actions
  agent.close()


def test_rollout_item_from_a_stage_bank_row():
  row = {"prompt": list(MESSAGES), "extra_info": {
      "state_id": "abc", "focus_stage": "S3", "source_pool": "s_mix",
      "workspace_recipe": {"track": "vqa", "outcome": "success", "seed": 3}}}
  it = RolloutItem.from_row(row, instance="inst")
  assert (it.state_id, it.focus, it.pool, it.instance) == ("abc", "S3", "s_mix", "inst")
  with pytest.raises(ValueError, match="missing field 'extra_info'"):
    RolloutItem.from_row({"prompt": []})
  assert dataclasses.replace(it, focus="E2E").focus == "E2E"


def test_unrenderable_prompt_and_context_limit(chat):
  script = lambda s, k: chat.render_action(action(f"print({k})"))
  limit = len(chat.encode_prompt(list(MESSAGES))) + 150
  loop, _, _ = make_loop(chat, script, limits=RolloutLimits(max_context_tokens=limit))
  bad = RolloutItem("bad", "S1", "s_mix", ({"role": "user", "content": 5},), None)
  broken, full = loop.run([bad, item()], group_size=1)
  assert broken.finish_reason == "error" and "prompt could not be rendered" in broken.error
  assert full.finish_reason == "context_full" and full.num_turns >= 2
  assert len(full.token_ids) <= limit and sum(full.loss_mask) == full.num_response_tokens


def test_a_rubric_failure_scores_zero_and_stays_trainable(chat):
  """The rubric reads what the policy wrote: if it fails, the episode earns 0 and stays in the
  batch (dropping it would let a policy opt out of its bad episodes)."""
  class Choking(FakeEnv):
    def score(self):
      raise RecursionError("maximum recursion depth exceeded")
  script = lambda s, k: chat.render_action(action("print(1)")) if k < 1 else final("Done.")
  loop = AgentLoop(ScriptedEngine(chat, script), chat, lambda item, g: Choking())
  [traj] = loop.run([item()], group_size=1)
  assert traj.finish_reason == "agent_stop" and traj.trainable and traj.reward == 0.0
  assert "rubric failed: RecursionError" in traj.error



@pytest.mark.parametrize("focus,reason,calls", [
    ("S3", "stage_end", ["python tools/validate.py --cases v1"]),  # infer is S4's: the cut
    ("S4", "agent_stop", ["python tools/validate.py --cases v1",
                          "python tools/infer.py --data d1"]),
    ("E2E", "agent_stop", ["python tools/validate.py --cases v1",
                           "python tools/infer.py --data d1"]),
])
def test_stage_end_cuts_a_stage_local_row_at_the_next_stages_call(chat, focus, reason, calls):
  """`stage_end`: a stage-local row's turn that calls a later stage's command ends the
  trajectory unrun, and the turn's tokens are dropped (nothing of it is trained); a command of
  the row's own or an earlier stage runs, and an E2E row is never cut."""
  actions = [action("python tools/validate.py --cases v1", language="bash"),
             action("python tools/infer.py --data d1", language="bash")]
  script = lambda s, k: chat.render_action(actions[k]) if k < 2 else final("Done.")
  envs: dict[int, FakeEnv] = {}
  make_env = lambda it, g: envs.setdefault(g, FakeEnv())
  cut = AgentLoop(ScriptedEngine(chat, script), chat, make_env, concurrency=1, stage_end=True)
  row = dataclasses.replace(item(), focus=focus)
  [traj] = cut.run([row], group_size=1)
  assert traj.finish_reason == reason
  assert [code for _, code in envs[0].calls] == calls
  # Rolled out without the cut, the same script runs the same turns up to the cut.
  envs.clear()
  whole = AgentLoop(ScriptedEngine(chat, script), chat, make_env, concurrency=1)
  [full] = whole.run([row], group_size=1)
  assert full.finish_reason == "agent_stop" and len(envs[0].calls) == 2
  # Each kept turn's span holds exactly its generated tokens and names its call's stage.
  assert [st for _, _, st in full.turn_spans] == ["S3", "S4", None]
  for start, end, _ in traj.turn_spans:
    assert all(traj.loss_mask[start:end]) and not traj.loss_mask[end:end + 1] == [1]
  assert sum(e - s for s, e, _ in full.turn_spans) == full.num_response_tokens
  if reason == "stage_end":
    assert [st for _, _, st in traj.turn_spans] == ["S3"]  # the cut turn's span goes with it
    assert traj.num_turns == 2 and traj.num_tool_calls == 1
    # What is kept is the uncut trajectory up to the second turn: its prompt, first turn and
    # first observation, so the row ends on an observation and no token of the cut turn stays.
    assert traj.token_ids == full.token_ids[:len(traj.token_ids)]
    assert traj.loss_mask[-1] == 0 and sum(traj.loss_mask) == traj.num_response_tokens
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.sampler_logp)
  else:
    assert traj.token_ids == full.token_ids

