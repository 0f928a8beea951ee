"""Cells are paired and fixed by seed; the digests tell different measurements apart."""

import dataclasses

import pytest

from bat_jax import workflow
from bat_jax.evaluator.cells import Cell, cell_set_digest, make_cells, protocol_digest
from bat_jax.rollout_protocol import RolloutLimits
from bat_jax.sandbox import SandboxLimits


KEY = "5e" * 32  # a fixed run secret


def test_same_settings_give_the_same_cells():
  a, b = make_cells(7, 4, "lite", secret=KEY), make_cells(7, 4, "lite", secret=KEY)
  assert a == b and len(a) == 4 * len(workflow.TRACKS)
  assert cell_set_digest(a) == cell_set_digest(tuple(reversed(b)))
  per_track = [c for c in a if c.track == "vqa"]
  assert [c.outcome for c in per_track] == ["success", "recovery", "failure", "success"]


def test_digests_change_with_what_is_measured():
  base = make_cells(7, 3, "lite", secret=KEY)
  assert cell_set_digest(make_cells(8, 3, "lite", secret=KEY)) != cell_set_digest(base)
  assert cell_set_digest(make_cells(7, 3, "standard", secret=KEY)) != cell_set_digest(base)
  assert cell_set_digest(make_cells(7, 2, "lite", secret=KEY)) != cell_set_digest(base)
  assert cell_set_digest(make_cells(7, 3, "lite", secret="a" * 64)) != cell_set_digest(base)
  limits, sandbox = RolloutLimits(), SandboxLimits()
  ref = protocol_digest(base, limits, sandbox)
  assert ref == protocol_digest(base, limits, sandbox)
  assert protocol_digest(base, dataclasses.replace(limits, max_tool_calls=22), sandbox) != ref
  assert protocol_digest(base, limits, dataclasses.replace(sandbox, wall_s=5.0)) != ref


def test_bad_cells_and_limits_are_named():
  with pytest.raises(ValueError, match="Cell.track 'xray'"):
    Cell("xray", "success", 0, "lite")
  with pytest.raises(ValueError, match="Cell.tier"):
    Cell("vqa", "success", 0, "gold")
  with pytest.raises(ValueError, match="max_assistant_turns"):
    RolloutLimits(max_assistant_turns=0)
  with pytest.raises(ValueError, match="cells_per_track"):
    make_cells(0, 0, "lite")


def test_settings_follow_the_run_config():
  from configs import base
  from bat_jax.run_config import RunConfig
  cfg = base.base_config()
  cfg.model.path = "checkpoint"  # a reference config needs one; nothing is read here
  run = RunConfig.from_config(cfg)
  settings = run.evaluation
  assert settings.tier == cfg.evaluator.tier and settings.seed == cfg.evaluator.seed
  assert settings.limits == run.rollout.limits == RolloutLimits()  # the training rollouts'
  assert settings.sandbox_limits == run.sandbox == SandboxLimits()
  assert len(settings.cells()) == cfg.evaluator.cells_per_track * len(workflow.TRACKS)


def test_heldback_cells_share_the_measurement_but_no_task():
  from bat_jax.evaluator.evaluate import EvalSettings
  gate = EvalSettings(seed=7, cells_per_track=4, secret=KEY)
  heldback = gate.heldback(3)
  assert (heldback.secret, heldback.tier, heldback.limits) == (gate.secret, gate.tier,
                                                                gate.limits)
  cells = heldback.cells()
  assert len(cells) == 3 * len(workflow.TRACKS)
  assert not {c.seed for c in cells} & {c.seed for c in gate.cells()}
  assert cell_set_digest(cells) != cell_set_digest(gate.cells())
  assert heldback.cells() == cells  # fixed by the run secret, like the gate's
