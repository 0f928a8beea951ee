"""Host-side watches of a running call: its memory (when no cgroup charges it) and its disk.

The fallback memory count charges what a cgroup would: each process's anonymous and shmem
resident pages (shared anonymous mappings count in every process that maps them: conservative),
memfd files held open but not mapped (their allocated blocks), and the sandbox's own /tmp and
/dev/shm tmpfs (statvfs through /proc/<pid1>/root). File-backed pages (the interpreter, the
workspace's page cache) are not the call's memory and are not counted.
"""

from __future__ import annotations

import os
from typing import Iterable

_SCRATCH_MOUNTS = ("tmp", "dev/shm")


def tree_pids(root_pid: int) -> list[int]:
  """root_pid and its descendants (orphans in the sandbox re-parent to its PID 1)."""
  children: dict[int, list[int]] = {}
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        stat = f.read()
    except OSError:
      continue  # exited meanwhile
    ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # comm may hold spaces and parens
    children.setdefault(ppid, []).append(int(name))
  found, stack = [], [root_pid]
  while stack:
    pid = stack.pop()
    found.append(pid)
    stack.extend(children.get(pid, ()))
  return found


def _process_bytes(pid: int) -> int:
  total = 0
  try:
    with open(f"/proc/{pid}/status", "rb") as f:
      for line in f:
        if line.startswith((b"RssAnon:", b"RssShmem:")):
          total += int(line.split()[1]) << 10
  except (OSError, ValueError):
    return 0
  return total + _memfd_bytes(pid)


def _memfd_bytes(pid: int) -> int:
  """Blocks of memfd files pid holds open (counted even when not mapped)."""
  total = 0
  try:
    fds = os.listdir(f"/proc/{pid}/fd")
  except OSError:
    return 0
  for fd in fds:
    path = f"/proc/{pid}/fd/{fd}"
    try:
      if os.readlink(path).startswith("/memfd:"):
        total += os.stat(path).st_blocks * 512
    except OSError:
      continue
  return total


def _host_devs() -> set[int]:
  devs = set()
  for path in ("/", *(f"/{m}" for m in _SCRATCH_MOUNTS)):
    try:
      devs.add(os.stat(path).st_dev)
    except OSError:
      pass
  return devs


def _scratch_bytes(pid1: int) -> int:
  """Used bytes of the sandbox's own /tmp and /dev/shm (nothing while bwrap still sets up).

  Each mount is opened once and both checks read that fd: two path walks can straddle bwrap's
  pivot_root, so a stat could see its setup tmpfs on /tmp and a statvfs the host's disk below."""
  total, host = 0, _host_devs()
  for mount in _SCRATCH_MOUNTS:
    try:
      fd = os.open(f"/proc/{pid1}/root/{mount}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
      continue
    try:
      if os.fstat(fd).st_dev in host:
        continue  # not yet pivoted: that is the host's folder
      st = os.statvfs(fd)
    except OSError:
      continue
    finally:
      os.close(fd)
    total += (st.f_blocks - st.f_bfree) * st.f_frsize
  return total


def call_memory_bytes(pid1: int, pids: Iterable[int] = ()) -> int:
  """Memory the call holds: its processes' anon + shmem + memfd, plus its scratch tmpfs."""
  return sum(_process_bytes(p) for p in (pids or tree_pids(pid1))) + _scratch_bytes(pid1)
