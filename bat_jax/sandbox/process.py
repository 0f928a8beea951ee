"""Running one bwrap call: its fds, the process, bounded output, and the watches that stop it.

`run_bwrap` is the only place a sandbox process is started. Whatever happens (a limit, a
monitor raising, the harness interrupted), it returns or raises only after the sandbox's PID 1,
hence every process of the call, is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import select
import selectors
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from bat_jax.sandbox import cgroup, monitor, seccomp

# RLIMIT_AS caps each process; the whole call's private memory is polled this often.
_MEMORY_POLL_S = 0.1
# The workspace's size, entry count and depth are checked this often during a call.
_WATCH_POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class Completed:
  returncode: int
  stdout: bytes
  stderr: bytes
  timed_out: bool
  output_exceeded: bool
  memory_exceeded: bool = False
  watch_limit: Optional[str] = None  # what `watch` reported (the workspace caps)


@dataclasses.dataclass
class CallFds:
  """The fds one bwrap call inherits; -1 once closed. `run_bwrap` closes what it consumes."""
  workspace: int   # O_PATH fd of the workspace, bound at /workspace
  info_r: int      # bwrap writes {"child-pid": ...} to info_w; the harness reads info_r
  info_w: int
  seccomp: int     # read end of a pipe holding the BPF program
  block_r: int = -1  # with a memory cgroup: bwrap waits on it until PID 1 is in the group
  block_w: int = -1

  def close(self, *names: str) -> None:
    for name in names:
      fd = getattr(self, name)
      if fd >= 0:
        setattr(self, name, -1)
        os.close(fd)


@contextlib.contextmanager
def call_fds(workspace: Path, no_sysv_shm: bool = False,
             block: bool = False) -> Iterator[CallFds]:
  """Opens the fds of one call (block: also the --block-fd pipe) and closes whichever are
  still open at exit."""
  fds = CallFds(-1, -1, -1, -1)
  try:
    fds.workspace = os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    fds.info_r, fds.info_w = os.pipe()
    if block:
      fds.block_r, fds.block_w = os.pipe()
    fds.seccomp, seccomp_w = os.pipe()
    try:  # a few hundred bytes: fits the pipe buffer, so this never blocks
      os.write(seccomp_w, seccomp.no_userns_filter(no_sysv_shm=no_sysv_shm))
    finally:
      os.close(seccomp_w)
    yield fds
  finally:
    fds.close("workspace", "info_r", "info_w", "seccomp", "block_r", "block_w")


def _read_pid1(info: bytes) -> Optional[int]:
  try:
    pid = json.loads(info.decode())["child-pid"]
  except (ValueError, KeyError, TypeError, UnicodeDecodeError):
    return None
  return pid if isinstance(pid, int) and pid > 1 else None


def _kill_sandbox(proc: subprocess.Popen, pid1_fd: Optional[int]) -> None:
  """SIGKILLs the sandbox's PID 1 (the kernel then kills its whole pid namespace) and bwrap."""
  if pid1_fd is not None:
    try:
      signal.pidfd_send_signal(pid1_fd, signal.SIGKILL)
    except (ProcessLookupError, OSError):
      pass
  try:
    os.killpg(proc.pid, signal.SIGKILL)  # bwrap leads its own session (start_new_session)
  except (ProcessLookupError, PermissionError):
    pass


@dataclasses.dataclass
class _Watch:
  """State of one running call, read and updated by `run_bwrap`'s loop."""
  proc: subprocess.Popen
  pid1_fd: Optional[int] = None
  pid1: Optional[int] = None
  info: bytearray = dataclasses.field(default_factory=bytearray)
  total: int = 0
  stopped: Optional[str] = None  # "wall", "output", "memory" or a `watch` limit
  fds: Optional[CallFds] = None
  memory_cgroup: Optional[cgroup.MemoryCgroup] = None


def _launch(argv: list[str], fds: CallFds) -> subprocess.Popen:
  passed = (fds.workspace, fds.info_w, fds.seccomp) + ((fds.block_r,) if fds.block_r >= 0 else ())
  try:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, pass_fds=passed,
                            start_new_session=True, env={"PATH": "/usr/bin:/bin"})
  finally:
    fds.close("info_w", "seccomp", "block_r")  # bwrap has its copies


def _into_cgroup(w: _Watch) -> None:
  """Moves the (blocked) sandbox PID 1 into the call's memory cgroup, then lets it run: the
  code is started after this, so every process of the call is charged to the group."""
  with open(w.memory_cgroup.procs_file, "w") as f:
    f.write(str(w.pid1))
  os.write(w.fds.block_w, b"1")
  w.fds.close("block_w")


def _on_read(w: _Watch, what: str, chunk: bytes, bufs: dict, max_output_bytes: int) -> None:
  if what == "info":
    w.info += chunk
    if w.pid1_fd is None:
      w.pid1 = _read_pid1(bytes(w.info))
      if w.pid1 is not None:  # bwrap has not reaped it: the pid is still its
        w.pid1_fd = os.pidfd_open(w.pid1)
        if w.memory_cgroup is not None:
          _into_cgroup(w)
    return
  room = max_output_bytes - w.total
  bufs[what] += chunk[:max(room, 0)]
  w.total += len(chunk)
  if w.total > max_output_bytes:
    w.stopped = "output"


def run_bwrap(argv: list[str], fds: CallFds, *, wall_s: float, max_output_bytes: int,
              max_memory_bytes: int, memory_cgroup: Optional[cgroup.MemoryCgroup] = None,
              watch: Optional[Callable[[], Optional[str]]] = None) -> Completed:
  """Runs argv, capturing at most max_output_bytes of stdout+stderr.

  Kills the sandbox at wall_s, at the output cap, when its memory goes over max_memory_bytes
  (the kernel does it in `memory_cgroup`; otherwise polled every _MEMORY_POLL_S), or when
  `watch()` (polled every _WATCH_POLL_S) names a limit. Returns only after the sandbox's PID 1,
  hence every process of the call, has exited; if anything here raises, the sandbox is killed
  before the exception propagates.
  """
  if not (isinstance(wall_s, (int, float)) and math.isfinite(wall_s) and wall_s > 0):
    raise ValueError(f"run_bwrap: wall_s must be a finite positive number, got {wall_s!r}")
  deadline = time.monotonic() + wall_s
  if (memory_cgroup is not None) != (fds.block_w >= 0):
    raise ValueError("run_bwrap: a memory cgroup needs bwrap started with --block-fd "
                     "(call_fds(block=True), bwrap_argv(block_fd=...)) and only then")
  w = _Watch(_launch(argv, fds), fds=fds, memory_cgroup=memory_cgroup)
  bufs = {"stdout": bytearray(), "stderr": bytearray()}
  next_memory = next_watch = time.monotonic()
  sel = selectors.DefaultSelector()
  try:
    sel.register(w.proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(w.proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(fds.info_r, selectors.EVENT_READ, "info")
    while sel.get_map() and w.stopped is None:
      now = time.monotonic()
      if now >= deadline:
        w.stopped = "wall"
        break
      if w.pid1 is not None and now >= next_memory:  # an OOM kill in the group ends the call
        if (memory_cgroup.oom_killed() if memory_cgroup is not None
            else monitor.call_memory_bytes(w.pid1) > max_memory_bytes):
          w.stopped = "memory"
        next_memory = now + _MEMORY_POLL_S
      if watch is not None and now >= next_watch:
        w.stopped = w.stopped or watch()
        # A big workspace makes the walk slow: keep it to a fifth of the host's time or less.
        next_watch = now + max(_WATCH_POLL_S, 4 * (time.monotonic() - now))
      wake = min(deadline, next_watch if watch is not None else deadline,
                 next_memory if w.pid1 is not None else deadline)
      for key, _ in sel.select(timeout=max(wake - now, 0.0)):
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
          sel.unregister(key.fileobj)
        else:
          _on_read(w, key.data, chunk, bufs, max_output_bytes)
    if w.stopped is None:
      try:
        returncode = w.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
      except subprocess.TimeoutExpired:
        w.stopped = "wall"
    if w.stopped is not None:
      _kill_sandbox(w.proc, w.pid1_fd)
      returncode = w.proc.wait()
    if w.pid1_fd is not None:  # bwrap reaps PID 1 before it exits; this just makes it certain
      waiter = select.poll()
      waiter.register(w.pid1_fd, select.POLLIN)
      waiter.poll(5000)
  except BaseException:
    _kill_sandbox(w.proc, w.pid1_fd)  # never leave a sandbox running behind an exception
    w.proc.wait()
    raise
  finally:
    sel.close()
    w.proc.stdout.close()
    w.proc.stderr.close()
    fds.close("info_r")
    if w.pid1_fd is not None:
      os.close(w.pid1_fd)
  if returncode < 0:  # bwrap itself killed by a signal: shell convention
    returncode = 128 - returncode
  oom = memory_cgroup is not None and memory_cgroup.oom_killed()
  known = ("wall", "output", "memory")
  return Completed(returncode, bytes(bufs["stdout"]), bytes(bufs["stderr"]),
                    w.stopped == "wall", w.stopped == "output",
                    w.stopped == "memory" or oom,
                    w.stopped if w.stopped not in known and w.stopped is not None else None)
