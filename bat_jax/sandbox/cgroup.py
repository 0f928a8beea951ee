"""A memory cgroup per `Sandbox`, when this host lets the harness make one.

A memory cgroup charges everything a call's processes make resident: anonymous memory, shared
anonymous mappings (once, to whoever touched them), memfd and tmpfs pages (the sandbox's /tmp
and /dev/shm), so `memory_mb` holds for the whole call however the memory is held. The kernel
OOM-kills inside the group at the limit; the harness reads that back as the "memory" limit (a
rise of the group's OOM-kill count over the call).

The group is made once per Sandbox and holds its launcher (`launcher.py`), which forks every
call's bwrap inside it: no call pays a cgroup migration. Calls of a Sandbox run one at a time,
and what a call held is freed when it ends (its processes are gone, its tmpfs mounts and IPC
namespace with them); only page cache of workspace files stays charged, and the kernel reclaims
that before it OOM-kills.

Both layouts are handled: cgroup v2 with the memory controller enabled for our group, and
cgroup v1's memory hierarchy (what this project's CI host has). Where neither is writable (an
unprivileged harness, a locked-down container), `available()` is False and the sandbox falls
back to polling the call's memory (bwrap.py), which counts shared and memfd pages too.
"""

from __future__ import annotations

import functools
import os
import secrets
import time
from pathlib import Path
from typing import Optional

_ROOT = Path("/sys/fs/cgroup")
# bwrap's own processes live in the group too; this much on top of the call's limit.
_OVERHEAD_BYTES = 16 << 20


@functools.lru_cache(maxsize=None)
def _parent() -> Optional[tuple[int, Path]]:
  """(version, folder) under which per-call groups are made, or None when we cannot."""
  try:
    lines = Path("/proc/self/cgroup").read_text().splitlines()
  except OSError:
    return None
  for line in lines:
    _, controllers, path = line.split(":", 2)
    if controllers == "" and (_ROOT / "cgroup.controllers").exists():
      here = _ROOT / path.lstrip("/")
      try:  # v2: a leaf cannot hold processes and children; make a child only where allowed
        if "memory" in (here / "cgroup.subtree_control").read_text().split():
          return _probe(2, here)
      except OSError:
        pass
    if "memory" in controllers.split(","):
      found = _probe(1, _ROOT / "memory" / path.lstrip("/"))
      if found is not None:
        return found
  return None


def _probe(version: int, parent: Path) -> Optional[tuple[int, Path]]:
  probe = parent / f"bat-sandbox-probe-{secrets.token_hex(4)}"
  try:
    probe.mkdir()
  except OSError:
    return None
  try:
    limit = probe / ("memory.max" if version == 2 else "memory.limit_in_bytes")
    limit.write_text(str(64 << 20))
    return version, parent
  except OSError:
    return None
  finally:
    try:
      probe.rmdir()
    except OSError:
      pass


def available() -> bool:
  return _parent() is not None


class MemoryCgroup:
  """One Sandbox's memory cgroup."""

  def __init__(self, limit_bytes: int):
    parent = _parent()
    if parent is None:
      raise OSError("no writable memory cgroup on this host")
    self.version, base = parent
    self.path = base / f"bat-sandbox-{os.getpid()}-{secrets.token_hex(6)}"
    self.path.mkdir()
    try:
      limit = str(limit_bytes + _OVERHEAD_BYTES)
      if self.version == 2:
        (self.path / "memory.max").write_text(limit)
        (self.path / "memory.swap.max").write_text("0")
        (self.path / "memory.oom.group").write_text("1")
      else:
        (self.path / "memory.limit_in_bytes").write_text(limit)
        memsw = self.path / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # no swap accounting on some kernels; then there is no swap to use
          memsw.write_text(limit)
    except BaseException:
      self.remove()
      raise

  def add(self, pid: int) -> None:
    """Moves process pid (and what it forks from then on) into the group."""
    (self.path / "cgroup.procs").write_text(str(pid))

  def oom_kills(self) -> int:
    """How many processes the kernel has OOM-killed in the group so far."""
    name = "memory.events" if self.version == 2 else "memory.oom_control"
    try:
      for line in (self.path / name).read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
          return int(value)
    except (OSError, ValueError):
      return 0
    return 0

  def remove(self) -> None:
    """Removes the group (its processes have exited; retried briefly while they are reaped)."""
    for _ in range(50):
      try:
        self.path.rmdir()
        return
      except FileNotFoundError:
        return
      except OSError:
        time.sleep(0.01)
