"""SFT rows end to end: real expert actions executed in the bubblewrap sandbox, then published."""

import pytest

from bat_jax import markers
from bat_jax import workflow
from bat_jax.stagebank import grid
from bat_jax.stagebank import leakcheck
from bat_jax.stagebank import sft_rows

from bat_jax import tasks

# Two foci of one task (the S3 row's boundary reuses the S2 row's cached snapshot) + one more.
STATES = (grid.GridState("S2", "segmentation", "recovery"),
          grid.GridState("S3", "segmentation", "recovery"),
          grid.GridState("S1", "report", "failure"))


def test_sft_set_from_executed_expert_actions(tmp_path, require_bwrap):
  checker = leakcheck.LeakChecker(markers.MarkerMatcher(markers.empty_export()),
                                   allow_no_markers=True)
  spec = sft_rows.SftSpec(seed=4, states=STATES)
  out = sft_rows.build_sft_set(tmp_path / "sft", spec, checker)
  rows = sft_rows.load_sft_rows(out)
  assert rows
  for state in STATES:
    mine = [r for r in rows if r["metadata"]["grid_state"] == state.key]
    recipe = mine[0]["metadata"]["workspace_recipe"]
    instance = tasks.FAMILIES[state.track].generate(recipe["seed"], state.outcome)
    expert = sft_rows.focus_actions(tasks, instance, state.focus)
    assert len(mine) == len(expert) > 0
    for k, row in enumerate(mine):
      assert sft_rows.target_action(row) == expert[k]
      observations = [m["content"] for m in row["messages"] if m["role"] == "tool"]
      assert len(observations) == k
      assert all(o.startswith("exit_code=") for o in observations)
      assert all(len(o) <= workflow.MAX_OBSERVATION_CHARS for o in observations)
