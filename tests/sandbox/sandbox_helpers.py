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
