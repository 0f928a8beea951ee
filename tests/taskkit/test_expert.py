"""The expert solver and stage-boundary workspaces in the real sandbox: every track x outcome x
boundary scores >= 0.95."""

import json

import pytest

from bat_jax import workflow
from bat_jax.sandbox import SandboxLimits, fingerprint
from bat_jax.taskkit import expert_actions, expert_episode, materialize_at
from bat_jax.taskkit.episodes import EVIDENCE, HANDOFF_EVIDENCE
from bat_jax.train_tasks import FAMILIES  # concrete tasks to run the machinery on

CELLS = [(t, o) for t in workflow.TRACKS for o in workflow.OUTCOMES]
LIMITS = SandboxLimits(wall_s=60.0)


def test_actions_are_model_neutral_execute_code():
  inst = FAMILIES["report"].generate(1, "recovery")
  for stage in workflow.STAGES:
    actions = expert_actions(inst, stage)
    assert actions, stage
    for a in actions:
      assert set(a) == {"name", "arguments", "thought"} and a["name"] == workflow.TOOL_NAME
      assert set(a["arguments"]) == {"language", "code"}
      assert a["arguments"]["language"] in workflow.TOOL_LANGUAGES and a["thought"]
      assert len(a["arguments"]["code"]) < 8000  # fits an SFT target
  with pytest.raises(ValueError, match="S6"):
    expert_actions(inst, "S6")


def test_recovery_fix_follows_the_fault():
  codes = {}
  for seed in range(40):
    inst = FAMILIES["segmentation"].generate(seed, "recovery")
    codes.setdefault(inst.hidden["fault"], " ".join(
        a["arguments"]["code"] for a in expert_actions(inst, "S3")))
  assert "exclude" in codes["corrupted_case"] and "converter" in codes["version_mismatch"]
  assert '"maxval"' in codes["degenerate_output"]


@pytest.mark.parametrize("i,cell", list(enumerate(CELLS)))
def test_expert_scores_on_every_cell(require_bwrap, tmp_path, i, cell):
  """One seed per cell: E2E, then two stage boundaries (rotating, so each boundary is covered
  for every outcome and most tracks; the slow sweep covers every cell x boundary x 20 seeds)."""
  track, outcome = cell
  inst = FAMILIES[track].generate(100 + i, outcome)
  e2e = expert_episode(inst, workflow.E2E, tmp_path / "e2e", LIMITS, cache_dir=tmp_path / "c")
  assert e2e.result.reward >= 0.95, e2e.result
  assert e2e.result.task_score >= 0.95
  for stage in (workflow.STAGES[i % 5], workflow.STAGES[(i + 3) % 5]):
    local = expert_episode(inst, stage, tmp_path / stage, LIMITS, cache_dir=tmp_path / "c")
    assert local.result.reward >= 0.95, (stage, local.result)
    assert set(local.result.stage_scores) == {stage} and local.result.task_score is None


def test_materialize_at_boundary(require_bwrap, tmp_path):
  inst = FAMILIES["vqa"].generate(7, "recovery")
  sandbox = materialize_at(inst, "S4", tmp_path / "row", LIMITS)
  ws = sandbox.workspace
  assert sandbox.evidence == [] and (tmp_path / "row" / HANDOFF_EVIDENCE).is_file()
  log = tmp_path / "row" / EVIDENCE
  assert not log.exists() or log.read_text() == ""
  for key in ("plan", "environment", "checkpoint", "pipeline", "validation_receipt",
              "correction"):
    assert (ws / workflow.ARTIFACTS[key]).is_file(), key
  assert not (ws / workflow.ARTIFACTS["predictions"]).exists()
  assert json.loads((ws / workflow.ARTIFACTS["diagnosis"]).read_text())["fault"] == \
      inst.hidden["fault"]
  # A cached boundary gives the same workspace; a fresh E2E row has only the task files.
  again = materialize_at(inst, "S4", tmp_path / "row2", LIMITS, cache_dir=tmp_path / "c")
  cached = materialize_at(inst, "S4", tmp_path / "row3", LIMITS, cache_dir=tmp_path / "c")
  assert fingerprint(again.workspace) == fingerprint(cached.workspace)
  fresh = materialize_at(inst, workflow.E2E, tmp_path / "row4", LIMITS)
  assert set(fingerprint(fresh.workspace)) == set(inst.files)
  with pytest.raises(FileExistsError, match="row4"):
    materialize_at(inst, "S2", tmp_path / "row4", LIMITS)
  with pytest.raises(ValueError, match="S9"):
    materialize_at(inst, "S9", tmp_path / "row5", LIMITS)
