"""Hostile artifacts (issue 24 item 2): `rubric.score` returns, the check scores 0 with a reason,
an evaluation with such a cell completes (threaded and process mode), and a training episode
that wrote them keeps its place in the GRPO batch with reward 0."""

import shutil

import pytest

from bat_jax import rubric, workflow
from bat_jax.evaluator import runner
from bat_jax.evaluator.cells import Cell
from bat_jax.sandbox import Sandbox
from bat_jax.taskkit import expert_actions, materialize_at, run_expert
from bat_jax.train_tasks import FAMILIES

from hacks import (HOSTILE_KINDS, LIMITS, HostileAgent, hostile_action, hostile_files,
                   score_bounded)

pytestmark = pytest.mark.usefixtures("require_bwrap")
TRACKS = ("classification", "detection")  # CSV and COCO-JSON submissions


@pytest.fixture(scope="module")
def solved(tmp_path_factory):
  """An E2E workspace solved by the expert, per track (copied by each test)."""
  if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap (bwrap) is not installed")
  out = {}
  for track in TRACKS:
    inst = FAMILIES[track].generate(3, "success")
    root = tmp_path_factory.mktemp(track)
    sandbox = materialize_at(inst, workflow.E2E, root / "row", LIMITS)
    run_expert(sandbox, inst, workflow.STAGES)
    out[track] = (inst, sandbox)
  return out


CASES = [(t, k) for t in TRACKS for k in HOSTILE_KINDS
         if hostile_files(FAMILIES[t].generate(3, "success"), k)]


@pytest.mark.parametrize("track,kind", CASES)
def test_hostile_artifacts_score_zero_with_a_reason(solved, tmp_path, track, kind):
  inst, done = solved[track]
  shutil.copytree(done.workspace, tmp_path / "ws")
  shutil.copy(done.evidence_path, tmp_path / "ev.jsonl")
  sandbox = Sandbox(tmp_path / "ws", LIMITS, evidence_path=tmp_path / "ev.jsonl")
  assert score_bounded(inst, sandbox).reward == 1.0
  action = hostile_action(inst, kind)
  assert sandbox.execute(**action["arguments"]).exit_code == 0
  res = score_bounded(inst, sandbox)
  hit = {s for s in workflow.STAGES for rel in hostile_files(inst, kind)
         if rel.split("/", 1)[0] in workflow.STAGE_DIRS[s]}
  for stage in hit:
    assert res.stage_scores[stage] < 1.0, (stage, res.stage_items[stage])
    reasons = " ".join(res.details[stage].values())
    assert reasons and "not met" not in reasons, res.details[stage]
  if kind == "deep_json":
    assert "nested over" in " ".join(res.details["S2"].values())
  if kind == "csv_field":
    assert "does not read back" in res.details["S5"]["submission_complete"]
    assert res.task_score == 0.0
  if kind in ("nested_parens", "unary_chain", "null_bytes"):
    assert res.stage_items["S2"]["pipeline_script_exists"] is False
    assert "probe" in res.details["S2"]["pipeline_script_exists"]
  assert res.reward < 1.0


@pytest.mark.parametrize("threads", [True, False], ids=["threads", "processes"])
def test_an_evaluation_with_hostile_cells_completes(tmp_path, threads):
  cells = [Cell("classification", "success", seed=7, tier="lite"),
           Cell("vqa", "success", seed=7, tier="lite")]
  options = runner.RunOptions(workers=2, threads=threads, cell_timeout_s=300.0)
  records = runner.run_cells(cells, HostileAgent, tmp_path / "rec", sandbox_limits=LIMITS,
                             options=options)
  hostile, healthy = records
  assert hostile["valid"] and healthy["valid"], records
  assert healthy["overall"] == 1.0
  assert hostile["stage_scores"]["S3"] == 0.0 and hostile["task_score"] == 0.0
  assert hostile["stage_details"]["S4"], hostile["stage_items"]


def test_a_harness_error_in_one_cell_keeps_the_others(tmp_path, monkeypatch):
  real = rubric.score

  def flaky(instance, focus, workspace, evidence):
    if instance.track == "classification":
      raise RuntimeError("rubric bug")
    return real(instance, focus, workspace, evidence)
  monkeypatch.setattr(rubric, "score", flaky)
  cells = [Cell("classification", "success", seed=7, tier="lite"),
           Cell("vqa", "success", seed=7, tier="lite")]
  from bat_jax.evaluator.agents import NullAgent
  records = runner.run_cells(cells, NullAgent, tmp_path / "rec", sandbox_limits=LIMITS,
                             options=runner.RunOptions(workers=2, threads=True))
  assert records[0]["invalid_reason"] == "crash" and "rubric bug" in records[0]["detail"]
  assert records[1]["valid"] and records[1]["overall"] == 0.0


def test_training_keeps_a_hostile_episode_with_reward_zero(chat, tmp_path):
  from bat_jax.bicurl.grpo_round import grpo_config, rollout_batch
  from bat_jax.rollout.agent_loop import AgentLoop, RolloutItem, task_environments
  from bat_jax.rollout.replay_engine import ScriptedEngine
  from tests.bicurl.fast_config import fast_config
  inst = FAMILIES["classification"].generate(3, "success")
  good = expert_actions(inst, "S4")
  bad = [hostile_action(inst, kind) for kind in ("deep_json", "wrong_types")]

  def script(session, k):
    actions = bad if session == 0 else good
    return chat.render_action(actions[k]) if k < len(actions) else \
        "Done.\n</think>\n\nAll done."
  envs = task_environments(tmp_path / "envs", LIMITS, cache_dir=tmp_path / "cache")
  loop = AgentLoop(ScriptedEngine(chat, script), chat, envs)
  item = RolloutItem(state_id="s4-row", focus="S4", pool="s_target",
                     messages=({"role": "system", "content": workflow.SYSTEM_PROMPT},
                               {"role": "user", "content": "Run inference."}), instance=inst)
  hostile, expert = loop.run([item], group_size=2)
  assert hostile.finish_reason == "agent_stop" and hostile.trainable, hostile.error
  assert hostile.reward == 0.0 and expert.reward == 1.0
  batch, stats = rollout_batch([hostile, expert], max_len=4096, cfg=grpo_config(fast_config()),
                               pad_id=0)
  assert stats["excluded_trajectories"] == 0 and stats["errors"] == 0
  assert batch["loss_mask"][0].sum() > 0  # kept, and pushed down by its advantage
  assert batch["advantages"][0] < 0 < batch["advantages"][1]
