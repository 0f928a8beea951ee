"""The outer loop on the SGLang path: `rollout.engine=sglang`, the launcher starting
`python -m bat_jax.serve` in place of `sglang.launch_server` (same flags), weight sync from disk
every step with version checks, memory release around the train step, SIGKILL and resume.

Slow (minutes on 2 cores: SFT compile + a server start per run); the per-step mechanism alone
is tests/rollout/test_sglang_policy_server.py in the default suite.
"""

import json
import os
import pathlib
import time

import numpy as np
import pytest

from bat_jax.bicurl import OuterState
from test_resume import _run_until

DRIVER = pathlib.Path(__file__).with_name("drive_sglang.py")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _servers_of(workdir: pathlib.Path) -> list[int]:
  """Live `bat_jax.serve` processes serving from `workdir` (orphans, if any)."""
  pids = []
  for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
    try:
      argv = cmdline.read_bytes().split(b"\0")
      state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
      continue
    if b"bat_jax.serve" in argv and str(workdir).encode() in b" ".join(argv) and state != "Z":
      pids.append(int(cmdline.parent.name))
  return pids


@pytest.mark.slow
def test_outer_loop_over_launched_bat_jax_serve_survives_sigkill(tmp_path, require_bwrap):
  env = {**os.environ, "PYTHONPATH": str(ROOT),
         "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  work = tmp_path / "run"
  assert _run_until(work, env, lambda: (work / "ckpt/round_000000/1").is_dir(), 1500.0, DRIVER), \
      "the run finished before the mid-round kill point"
  deadline = time.monotonic() + 30  # the server gets SIGTERM from the kernel (PDEATHSIG)
  while _servers_of(work) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not _servers_of(work), "the rollout server outlived the killed trainer"

  assert not _run_until(work, env, lambda: False, 1500.0, DRIVER)
  state = OuterState.load(work)
  (rec,) = state.rounds
  assert [s["step"] for s in rec.steps] == [1, 2]
  assert all(np.isfinite(s["loss"]) and s["errors"] == 0 for s in rec.steps)
  assert set(state.evaluations) == {"sft", "round_000000"}
  log = (work / "logs" / "sglang.log").read_text()
  assert log.count("bat_jax.serve: serving") == 2  # one server per process, restarted on resume
  exported = json.loads((work / "sglang_weights" / "config.json").read_text())
  assert exported["dtype"] == "bfloat16"
  assert not _servers_of(work)
