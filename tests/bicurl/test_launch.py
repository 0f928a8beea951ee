"""launch.py: the common mistakes fail before anything runs, in one line naming the flag at fault."""

import os
import pathlib
import subprocess
import sys

import pytest

from bat_jax.config_loading import directory_problem

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _launch(workdir, *args, config="configs/tiny.py"):
  return subprocess.run([sys.executable, "launch.py", f"--config={config}",
                         f"--workdir={workdir}", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def _one_line(done) -> str:
  assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize("override, message", [
    ("--config.grpo.lrr=1e-6",
     "launch.py: --config.grpo.lrr=1e-6: no config field 'lrr' (did you mean \"lr\"?)"),
    ("--config.grpoo.lr=1e-6", "--config.grpoo.lr=1e-6: no config field 'grpoo'"),
    ("--config.grpo.steps_per_round=many",
     "flag --config.grpo.steps_per_round=many: invalid literal for int()"),
    ("--config.curriculum.mode=argminn",
     "invalid config: config.curriculum.mode: unknown mode 'argminn'"),
])
def test_bad_override_fails_in_one_line_and_runs_nothing(tmp_path, override, message):
  line = _one_line(_launch(tmp_path / "run", override))
  assert message in line
  assert not (tmp_path / "run").exists()


def test_missing_config_file_is_one_line(tmp_path):
  line = _one_line(_launch(tmp_path / "run", config="configs/nope.py"))
  assert line == "launch.py: --config=configs/nope.py: no such config file 'configs/nope.py'"
  line = _one_line(_launch(tmp_path / "run", config="configs/tiny.py:bogus=1"))
  assert "--config=configs/tiny.py:bogus=1" in line and "unknown key 'bogus'" in line


def _unwritable(tmp_path):
  if os.geteuid() == 0:  # root writes through modes; /proc refuses even root
    return pathlib.Path("/proc/bat-jax-no-such-dir/run")
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o500)
  return locked / "run"


def test_unusable_workdir_fails_before_any_work_naming_the_flag(tmp_path):
  afile = tmp_path / "a_file"
  afile.write_text("x")
  line = _one_line(_launch(afile / "run"))
  assert line == f"launch.py: --workdir={afile / 'run'}: cannot be created, {afile} is not a " \
      "directory"


def test_directory_problem_names_each_kind_of_unusable_workdir(tmp_path):
  afile = tmp_path / "a_file"
  afile.write_text("x")
  assert directory_problem(afile) == f"--workdir={afile}: exists and is not a directory"
  assert "is not a directory" in directory_problem(afile / "deeper" / "run")
  unwritable = _unwritable(tmp_path)
  assert directory_problem(unwritable).startswith(f"--workdir={unwritable}: cannot be created in")
  assert directory_problem(tmp_path / "new" / "run") is None  # parents are created later
  assert directory_problem(tmp_path) is None and list(tmp_path.iterdir()) == [afile]  # no probe
