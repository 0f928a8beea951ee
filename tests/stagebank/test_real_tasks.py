"""A round built from the real training task families: clean, and free of hidden answers."""

import json

import pytest

from bat_jax import markers
from bat_jax import train_tasks
from bat_jax import workflow
from bat_jax.rollout.agent_loop import RolloutItem, TaskEnvironment
from bat_jax.stagebank import build
from bat_jax.stagebank import leakcheck
from bat_jax.stagebank import rounds
from bat_jax.stagebank import task_source

# 3 batches = 12 S-target + 6 S-mix + 6 E2E rows, spread over tracks and outcomes.
SPEC = rounds.RoundSpec(0, rounds.RoundWeights.for_target("S4"), seed=1, n_batches=3)


@pytest.fixture(scope="module")
def built():
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(markers.export_markers(
      ["heldout-case-0042"], salt="s")))
  return build.build_round(SPEC, task_source.TasksPackageSource(), checker)


def test_real_round_passes_the_leak_check(built):
  assert built.receipt.passed and built.receipt.rows_checked == 24


def test_rows_hold_no_hidden_answers_and_rebuild_from_their_recipe(built):
  for rows in built.pools.values():
    for row in rows:
      recipe = row["extra_info"]["workspace_recipe"]
      instance = train_tasks.FAMILIES[recipe["track"]].generate(recipe["seed"], recipe["outcome"])
      prov = row["extra_info"]["provenance"]
      assert prov["source_digest"] == task_source.files_digest(instance.files)
      assert prov["task_id"] == instance.task_id
      blob = json.dumps(row)
      hidden = instance.hidden
      secrets = list(hidden["case_ids"]) + [hidden["weights"]]
      if hidden["fault"]:
        secrets += [hidden["fault"], str(hidden["fault_subject"])]
      for secret in secrets:
        assert secret not in blob, (secret, recipe)
      brief = train_tasks.brief_for(instance, recipe["boundary_stage"])
      assert row["prompt"][1]["content"] == brief


def test_every_expert_action_passes_the_leak_check():
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(markers.empty_export()),
                                   allow_no_markers=True)
  n = 0
  for track in workflow.TRACKS:
    for outcome in workflow.OUTCOMES:
      instance = train_tasks.FAMILIES[track].generate(3, outcome)
      for stage in workflow.STAGES:
        for action in train_tasks.expert_actions(instance, stage):
          assert checker.check_row(action) == [], (track, outcome, stage, action)
          n += 1
  assert n > 100


def test_a_row_rebuilds_its_boundary_workspace(built, tmp_path, require_bwrap):
  """The rollout's path: the row's instance (digest-checked) in a TaskEnvironment."""
  row = next(r for r in built.pools["s_target"] if r["extra_info"]["target_stage"] == "S4")
  instance = task_source.instance_for(row)
  item = RolloutItem.from_row(row, instance)
  assert item.focus == row["extra_info"]["workspace_recipe"]["boundary_stage"] == "S4"
  sandbox = TaskEnvironment(item, tmp_path / "ws").sandbox
  assert instance.task_id == row["extra_info"]["provenance"]["task_id"]
  for stage in ("S1", "S2", "S3"):  # handoff artifacts of the earlier stages are present
    for d in workflow.STAGE_DIRS[stage]:
      assert (sandbox.workspace / d).is_dir(), d
  assert sandbox.evidence == []  # a fresh log for the agent
  tampered = json.loads(json.dumps(row))
  tampered["extra_info"]["provenance"]["source_digest"] = "0" * 64
  with pytest.raises(ValueError, match=row["extra_info"]["state_id"]):
    task_source.instance_for(tampered)


def test_the_environment_counts_the_agents_failed_calls(built, tmp_path, require_bwrap):
  """`Score.failed_calls`: the agent's calls that exited non-zero (the boundary's replayed
  expert calls are not the agent's)."""
  row = next(r for r in built.pools["s_target"] if r["extra_info"]["target_stage"] == "S4")
  env = TaskEnvironment(RolloutItem.from_row(row, task_source.instance_for(row)), tmp_path / "ws")
  assert env.score().failed_calls == 0
  env.execute("bash", "exit 3")
  env.execute("bash", "true")
  env.execute("bash", "python -c 'raise SystemExit(1)'")
  assert env.score().failed_calls == 2


def test_workspace_files_rows_reset_to_are_scanned():
  """A marker present only inside a task's workspace files (not in the row) rejects the round."""
  spec = rounds.RoundSpec(0, rounds.RoundWeights.for_target("S1"), seed=4, n_batches=1)
  source = task_source.TasksPackageSource()
  clean = leakcheck.LeakChecker(markers.MarkerMatcher(markers.export_markers(
      ["unrelated-heldout-9931"], salt="ws")))
  built = build.build_round(spec, source, clean)
  assert built.receipt.passed
  row = built.pools["s_target"][0]
  instance = task_source.instance_for(row)
  row_text = json.dumps(built.pools).lower()
  hidden = next(line.strip() for rel, content in sorted(instance.files.items())
                if rel.endswith((".csv", ".json", ".py", ".txt", ".md"))
                for line in content.decode("utf-8", "ignore").splitlines()
                if len(line.strip()) > 12 and line.strip().lower() not in row_text)
  leaky = leakcheck.LeakChecker(markers.MarkerMatcher(markers.export_markers([hidden],
                                                                            salt="ws")))
  with pytest.raises(leakcheck.RoundRejected, match="workspace:") as err:
    build.build_round(spec, source, leaky)
  assert err.value.receipt.rejections_by_reason["heldout_marker"] >= 1
