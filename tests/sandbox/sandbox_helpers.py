"""Shared by the sandbox tests: small limits and a stray-process probe."""

from __future__ import annotations

import os

from bat_jax.sandbox import SandboxLimits

# Small limits so bombs die fast; the escape suite must stay well under its time budget.
FAST = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, max_procs=16,
                     max_output_bytes=64 << 10, max_workspace_mb=8)


def processes_of(uid: int) -> list[int]:
  """Host pids whose real uid is `uid` (the sandboxed code's uid when the harness is root)."""
  pids = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        uid_line = next(line for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration):
      continue  # exited while we looked
    if int(uid_line.split()[1]) == uid:
      pids.append(int(name))
  return pids


def processes_running(marker: str) -> list[int]:
  """Host pids whose command line contains `marker` (a unique token the test put there)."""
  pids = []
  for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) == os.getpid():
      continue
    try:
      with open(f"/proc/{name}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
      continue
    if marker in cmdline:
      pids.append(int(name))
  return pids


# An unprivileged uid for host-side code run "as a non-root harness would run" it.
NOBODY = 65534
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_unprivileged(script: str, cwd: str, timeout: float = 240.0) -> dict:
  """Runs `script` (Python; its last stdout line is JSON) as uid/gid NOBODY with no supplementary
  groups or capabilities, importing this checkout's bat_jax, in `cwd` (made NOBODY's): the
  host-side code then meets permission bits as a non-root harness does. Skips where the host
  cannot (not root, no setpriv, no interpreter NOBODY can run)."""
  import json
  import shutil
  import subprocess
  import sys
  import pytest
  if os.geteuid() != 0 or shutil.which("setpriv") is None:
    pytest.skip("needs root and setpriv to drop to an unprivileged uid")
  os.chown(cwd, NOBODY, NOBODY)
  drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
          "--inh-caps=-all", "--bounding-set=-all"]
  env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": _REPO, "HOME": cwd, "TMPDIR": "/tmp"}
  # The probe execs the interpreter again: setpriv's own exec may still pass directory checks
  # the dropped uid fails (the launcher is started with sys.executable too).
  again = ("import subprocess, sys\n"
           "subprocess.run([sys.executable, '-c', 'import bat_jax.sandbox'], check=True)")
  for python in (sys.executable, "/usr/bin/python3"):
    probe = subprocess.run([*drop, python, "-c", again], env=env, cwd=cwd, capture_output=True)
    if probe.returncode == 0:
      break
  else:
    pytest.skip(f"uid {NOBODY} cannot run a Python that imports {_REPO}/bat_jax")
  done = subprocess.run([*drop, python, "-c", script], env=env, cwd=cwd, capture_output=True,
                        text=True, timeout=timeout)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])
