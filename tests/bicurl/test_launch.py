"""launch.py: misspelt or ill-typed overrides fail before anything runs, naming the field."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _launch(tmp_path, *overrides):
  return subprocess.run([sys.executable, "launch.py", "--config=configs/tiny.py",
                         f"--workdir={tmp_path / 'run'}", *overrides], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("override, message", [
    ("--config.grpo.lrr=1e-6", 'Did you mean "lr" instead of "lrr"'),
    ("--config.grpo.steps_per_round=many", "config.grpo.steps_per_round"),
    ("--config.curriculum.mode=argminn", "config.curriculum.mode: unknown mode 'argminn'"),
])
def test_bad_override_fails_clearly_and_runs_nothing(tmp_path, override, message):
  done = _launch(tmp_path, override)
  assert done.returncode != 0
  assert message in done.stderr
  assert not (tmp_path / "run").exists()
