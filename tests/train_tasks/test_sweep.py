"""The training side's expert sweep: every training track x outcome x focus, 20 seeds."""

import pytest

from bat_jax import workflow
from bat_jax.sandbox import SandboxLimits
from bat_jax.train_tasks.sweep import expert_sweep

LIMITS = SandboxLimits(wall_s=60.0)


@pytest.mark.slow
def test_expert_sweep_twenty_seeds(require_bwrap, tmp_path):
  table = expert_sweep(range(20), tmp_path, limits=LIMITS, processes=2)
  assert len(table) == len(workflow.TRACKS) * len(workflow.OUTCOMES) * len(workflow.FOCI)
  worst = {k: min(v) for k, v in table.items()}
  assert all(len(v) == 20 for v in table.values())
  assert min(worst.values()) >= 0.95, {k: v for k, v in worst.items() if v < 0.95}
