"""Two processes under jax.distributed (CPU collectives over gloo) run the fast config's SFT and
one GRPO round on a data-parallel mesh spanning both; both are SIGKILLed mid-SFT and mid-round
and resumed from the orbax multi-host checkpoints. Process 0 alone spawns the Stage Bank and
writes the shared files; each process rolls out its own state_id groups."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

DRIVER = pathlib.Path(__file__).with_name("drive_multihost.py")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_pair(workdir, logs, reached, timeout_s=1500.0) -> bool:
  """Starts both processes; SIGKILLs both once `reached()` holds. Returns whether killed."""
  env = {**os.environ, "PYTHONPATH": str(ROOT),
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
         "JAX_COMPILATION_CACHE_DIR": str(workdir.parent / "xla_cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  port = _free_port()
  procs = []
  for pid in (0, 1):
    log = open(logs / f"p{pid}.log", "ab")
    procs.append(subprocess.Popen([sys.executable, str(DRIVER), str(workdir), str(pid), str(port)],
                                  env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
  deadline = time.monotonic() + timeout_s
  try:
    while any(p.poll() is None for p in procs):
      if reached():
        for p in procs:
          p.send_signal(signal.SIGKILL)
        return True
      assert time.monotonic() < deadline, "the two-process run ran past its timeout"
      if any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.1)
  finally:
    for p in procs:
      if p.poll() is None and any(q.poll() not in (None, 0) for q in procs):
        p.kill()
      p.wait()
  for pid, p in enumerate(procs):
    assert p.returncode == 0, (logs / f"p{pid}.log").read_text(errors="replace")[-4000:]
  return False


@pytest.mark.slow
def test_two_processes_train_sft_and_a_round_killed_and_resumed(tmp_path, require_bwrap):
  workdir, logs = tmp_path / "run", tmp_path
  start = time.monotonic()
  assert _run_pair(workdir, logs, lambda: (workdir / "ckpt/sft/1").is_dir()), "no mid-SFT kill"
  assert _run_pair(workdir, logs, lambda: (workdir / "ckpt/round_000000/1").is_dir()), \
      "no mid-round kill"
  assert not _run_pair(workdir, logs, lambda: False)
  print(f"two-process run with two kills: {time.monotonic() - start:.0f} s")

  p0, p1 = (logs / "p0.log").read_text(), (logs / "p1.log").read_text()
  resumed = "ckpt/round_000000 at step 1"  # the Trainer's resume line, on both processes
  assert resumed in p0 and resumed in p1 and "ckpt/sft at step 1" in p1
  assert p0.count("Stage Bank spawned") == 3 and "Stage Bank spawned" not in p1
  assert "[p1]" in p1 and "round 0: target" in p1   # process 1 ran the loop to the end

  state = json.loads((workdir / "outer_state.json").read_text())
  assert state["sft_done"] and sorted(state["evaluations"]) == ["round_000000", "sft"]
  steps = state["rounds"][0]["steps"]
  assert [s["step"] for s in steps] == [1, 2]
  assert all(s["sampler_gap"] >= 0 and "sampler_gap_max" in s for s in steps)
  for policy in ("sft", "round_000000"):
    assert list((workdir / "policies" / policy).glob("*.safetensors"))
  assert sorted(p.name for p in (workdir / "ckpt/round_000000").iterdir() if p.name.isdigit()) == \
      ["1", "2"]
  assert (workdir / "report.json").is_file()
