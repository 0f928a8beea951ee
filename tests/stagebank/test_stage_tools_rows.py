"""Stage Bank rows in the `stage_tools` action space pass the leak pre-check against the real
held-out markers, carry their action space in the recipe and hold no hidden answers."""

import json

import pytest

from bat_jax import markers, train_tasks
from bat_jax.evaluator.evaluate import EvalSettings
from bat_jax.evaluator.markers_export import export_cells
from bat_jax.sandbox import SandboxLimits
from bat_jax.stagebank import build, leakcheck, rounds, task_source
from bat_jax.taskkit import expert_actions, materialize_at
from bat_jax.train_tasks import briefs

SPEC = rounds.RoundSpec(0, rounds.RoundWeights.for_target("S3"), seed=2, n_batches=3)


@pytest.fixture(scope="module")
def checker():
  cells = EvalSettings(cells_per_track=3, action_space="stage_tools").cells()
  return leakcheck.LeakChecker(markers.MarkerMatcher(export_cells(cells, salt=b"t")))


def test_round_passes_the_leak_check_and_rebuilds(checker):
  built = build.build_round(SPEC, task_source.stage_tools_source(), checker)
  assert built.receipt.passed and built.receipt.rows_checked == 24
  for rows in built.pools.values():
    for row in rows:
      recipe = row["extra_info"]["workspace_recipe"]
      assert recipe["action_space"] == "stage_tools"
      instance = task_source.instance_for(row)
      assert instance.action_space == "stage_tools"
      blob = json.dumps(row)
      hidden = instance.hidden
      # Past validation the fault is a handoff artifact (validation printed it, the repair or
      # the blocker's receipt names it), so an S4 / S5 row's handoff states it, there only.
      stage = recipe["boundary_stage"]
      if stage in ("S4", "S5") and instance.outcome != "success":
        handoff = briefs.tools_handoff(instance, stage).strip()
        assert handoff in blob and hidden["fault"] in handoff
        blob = blob.replace(handoff, "")
      for secret in ([hidden["fault"]] if hidden["fault"] else []) + [
          json.dumps(v) for v in hidden["expected"].values() if isinstance(v, str)]:
        assert secret not in blob, (secret, recipe)
      assert "tools/" in row["prompt"][1]["content"]


def test_tool_observations_pass_the_leak_check(checker, tmp_path, require_bwrap):
  """Observations name faults and subjects (e.g. `intensity_scale`): public, never flagged."""
  inst = next(i for i in (train_tasks.generate("enhancement", s, "recovery", "stage_tools")
                          for s in range(60)) if i.hidden["fault"] == "degenerate_output")
  sandbox = materialize_at(inst, "S3", tmp_path / "ws", SandboxLimits(wall_s=60.0))
  observations = []
  for action in expert_actions(inst, "S3"):
    res = sandbox.execute(action["arguments"]["language"], action["arguments"]["code"])
    assert res.exit_code == 0
    observations.append(res.observation)
    assert checker.check_row({"action": action, "observation": res.observation}) == []
  assert "fault: degenerate_output subject: intensity_scale" in observations[0]
  brief = train_tasks.brief_for(inst, "S3")
  assert "validate" not in brief and "S3" not in brief and "next stage only" in brief
