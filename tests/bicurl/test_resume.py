"""SIGKILL the outer loop mid-SFT, mid-round and mid-evaluation; the resumed run must end with
the same policies (param digests), targets and gate decisions as an uninterrupted run."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from bat_jax.bicurl import OuterState

DRIVER = pathlib.Path(__file__).with_name("drive_fast.py")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env(cache: pathlib.Path) -> dict:
  # A shared persistent compilation cache: restarts reuse what earlier processes compiled.
  return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": str(cache),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def _run_until(workdir, env, reached, timeout_s=900.0, driver=DRIVER) -> bool:
  """Starts the driver; SIGKILLs it once `reached()` holds. Returns whether it was killed."""
  proc = subprocess.Popen([sys.executable, str(driver), str(workdir)], env=env, cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.monotonic() + timeout_s
  while proc.poll() is None:
    if reached():
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      return True
    assert time.monotonic() < deadline, "driver ran past its timeout"
    time.sleep(0.05)
  assert proc.returncode == 0, proc.stderr.read().decode()[-3000:]
  return False


@pytest.mark.slow
def test_sigkill_and_resume_matches_an_uninterrupted_run(tmp_path, require_bwrap):
  env = _env(tmp_path / "xla_cache")
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  assert not _run_until(straight, env, lambda: False)

  kill_points = [
      ("mid-SFT", lambda: (killed / "ckpt/sft/1").is_dir()),
      ("mid-round", lambda: (killed / "ckpt/round_000000/1").is_dir()),
      ("mid-evaluation", lambda: any((killed / "eval_records/round_000001/cells").glob("*.json"))),
  ]
  for name, reached in kill_points:
    assert _run_until(killed, env, reached), f"the run finished before the {name} kill point"
  assert not _run_until(killed, env, lambda: False)

  a, b = OuterState.load(straight), OuterState.load(killed)
  assert a.evaluations.keys() == b.evaluations.keys()
  for policy in a.evaluations:
    assert a.evaluations[policy]["params_sha256"] == b.evaluations[policy]["params_sha256"], \
        policy
    assert a.evaluations[policy]["stage_scores"] == b.evaluations[policy]["stage_scores"]
  assert [(r.target, r.promoted, r.steps) for r in a.rounds] == \
      [(r.target, r.promoted, r.steps) for r in b.rounds]
  assert a.baseline == b.baseline
