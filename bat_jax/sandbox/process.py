"""Running one bwrap call: its fds, the process, bounded output, and the watches that stop it.

`run_bwrap` is the only place a sandbox process is started (through a `launcher.Launcher`).
Whatever happens (a limit, a monitor raising, the harness interrupted), it returns or raises
only after the sandbox's PID 1, hence every process of the call, is gone.

A launcher the OOM killer took mid-call (a non-root harness cannot exempt it; cgroup v2's group
kill takes every process of the group) is not an error of the harness: the call is killed and
returned as a memory-limit hit, and the Sandbox starts a fresh launcher for the next call.
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
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from bat_jax.sandbox import monitor, seccomp
from bat_jax.sandbox.launcher import Child, Launcher, LauncherError

# RLIMIT_AS caps each process; the whole call's private memory is polled this often.
_MEMORY_POLL_S = 0.1
# The workspace's size, entry count and depth are checked this often during a call.
_WATCH_POLL_S = 0.2
# After PID 1 is SIGKILLed, bwrap exits within this (else it is killed too).
_KILL_GRACE_S = 5.0
# After a SIGKILL, bwrap's exit status comes back within this (else the launcher is broken).
_REAP_TIMEOUT_S = 30.0
# The fd numbers bwrap gets `CallFds.passed()` as (bwrap_argv names these).
CHILD_WORKSPACE_FD, CHILD_INFO_FD, CHILD_SECCOMP_FD = 3, 4, 5


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

  def close(self, *names: str) -> None:
    for name in names:
      fd = getattr(self, name)
      if fd >= 0:
        setattr(self, name, -1)
        os.close(fd)

  def passed(self) -> tuple[int, int, int]:
    """The fds bwrap gets as CHILD_WORKSPACE_FD, CHILD_INFO_FD, CHILD_SECCOMP_FD."""
    return self.workspace, self.info_w, self.seccomp


@contextlib.contextmanager
def call_fds(workspace: Path, no_sysv_shm: bool = False) -> Iterator[CallFds]:
  """Opens the fds of one call and closes whichever are still open at exit."""
  fds = CallFds(-1, -1, -1, -1)
  try:
    fds.workspace = os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    fds.info_r, fds.info_w = os.pipe()
    fds.seccomp, seccomp_w = os.pipe()
    try:  # a few hundred bytes: fits the pipe buffer, so this never blocks
      os.write(seccomp_w, seccomp.no_userns_filter(no_sysv_shm=no_sysv_shm))
    finally:
      os.close(seccomp_w)
    yield fds
  finally:
    fds.close("workspace", "info_r", "info_w", "seccomp")


def _read_pid1(info: bytes) -> Optional[int]:
  try:
    pid = json.loads(info.decode())["child-pid"]
  except (ValueError, KeyError, TypeError, UnicodeDecodeError):
    return None
  return pid if isinstance(pid, int) and pid > 1 else None


def _sigkill(pidfd: int) -> None:
  try:
    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
  except (ProcessLookupError, OSError):
    pass


@dataclasses.dataclass
class _Watch:
  """State of one running call, read and updated by `run_bwrap`'s helpers."""
  launcher: Launcher
  child: Child
  out_r: dict[str, int]  # "stdout" / "stderr" -> read end
  fds: CallFds
  pid1_fd: Optional[int] = None
  pid1: Optional[int] = None
  info: bytearray = dataclasses.field(default_factory=bytearray)
  bufs: dict[str, bytearray] = dataclasses.field(
      default_factory=lambda: {"stdout": bytearray(), "stderr": bytearray()})
  total: int = 0
  stopped: Optional[str] = None  # "wall", "output", "memory" or a `watch` limit
  oom_base: int = 0  # the group's OOM-kill count before the call
  host_oom_base: int = 0  # the kernel's (every group's) OOM-kill count before the call
  returncode: Optional[int] = None

  def kill(self) -> None:
    """SIGKILLs the sandbox's PID 1 (the kernel then kills its whole pid namespace; bwrap reaps
    it and exits), and waits for bwrap's exit status. bwrap itself is killed when PID 1 is not
    known yet or bwrap outlives the grace (its --die-with-parent then kills PID 1)."""
    if self.pid1_fd is not None:
      _sigkill(self.pid1_fd)
      self.returncode = self.launcher.wait(_KILL_GRACE_S)
    if self.returncode is None:
      _sigkill(self.child.pidfd)
      self.returncode = self.launcher.wait(_REAP_TIMEOUT_S)
    if self.returncode is None:
      raise LauncherError("sandbox launcher gave no exit status after SIGKILL")

  def close(self) -> None:
    for fd in (*self.out_r.values(), self.child.pidfd, self.pid1_fd):
      if fd is not None and fd >= 0:
        os.close(fd)
    self.fds.close("info_r")


def _start(argv: Sequence[str], fds: CallFds, launcher: Launcher, run_as: Optional[int],
           rlimits: Sequence[tuple[int, int, int]]) -> _Watch:
  pipes = {"stdout": os.pipe(), "stderr": os.pipe()}
  try:
    oom_base = launcher.group.oom_kills() if launcher.group is not None else 0
    host_oom_base = host_oom_kills()
    child = launcher.start(argv, pipes["stdout"][1], pipes["stderr"][1], fds.passed(),
                           run_as=run_as, rlimits=rlimits)
  except BaseException:
    for r, w in pipes.values():
      os.close(r)
      os.close(w)
    raise
  finally:
    fds.close("info_w", "seccomp")  # bwrap has its copies
  for _, w in pipes.values():
    os.close(w)
  return _Watch(launcher, child, {k: r for k, (r, _) in pipes.items()}, fds, oom_base=oom_base,
                host_oom_base=host_oom_base)


def host_oom_kills() -> int:
  """The kernel's OOM-kill count since boot, memory cgroups' included (0 if unreadable)."""
  try:
    with open("/proc/vmstat", "rb") as f:
      for line in f:
        if line.startswith(b"oom_kill "):
          return int(line.split()[1])
  except (OSError, ValueError):
    pass
  return 0


def _after_lost_launcher(w: _Watch) -> None:
  """The launcher died mid-call. Kills what is left of the call and waits for it, then closes
  the launcher (the Sandbox starts a new one). An OOM kill during the call (in the group or on
  the host) makes it a memory-limit hit; otherwise the launcher's loss is a LauncherError."""
  alive = [fd for fd in (w.pid1_fd, w.child.pidfd) if fd is not None]
  for fd in alive:
    _sigkill(fd)
  for fd in alive:  # a pidfd polls readable once its process has exited
    select.select([fd], [], [], _REAP_TIMEOUT_S)
  group = w.launcher.group
  oom = (group is not None and group.oom_kills() > w.oom_base) or \
      host_oom_kills() > w.host_oom_base
  w.launcher.close()
  if not oom:
    raise LauncherError(f"sandbox launcher (pid {w.launcher.pid}) died during a call, and no "
                        "OOM kill explains it")
  w.returncode, w.stopped = -signal.SIGKILL, "memory"


def _on_read(w: _Watch, what: str, chunk: bytes, max_output_bytes: int) -> None:
  if what == "info":
    w.info += chunk
    if w.pid1_fd is None:
      w.pid1 = _read_pid1(bytes(w.info))
      if w.pid1 is not None:  # bwrap reaps it only as it exits itself: the pid is still its
        try:
          w.pid1_fd = os.pidfd_open(w.pid1)
        except ProcessLookupError:  # the call is over already
          w.pid1 = None
    return
  room = max_output_bytes - w.total
  w.bufs[what] += chunk[:max(room, 0)]
  w.total += len(chunk)
  if w.total > max_output_bytes:
    w.stopped = "output"


def _over_memory(w: _Watch, max_memory_bytes: int) -> bool:
  """An OOM kill in the group (the kernel enforces it there), else the polled count."""
  group = w.launcher.group
  if group is not None:
    return group.oom_kills() > w.oom_base
  return monitor.call_memory_bytes(w.pid1) > max_memory_bytes


def _pump(w: _Watch, deadline: float, max_output_bytes: int, max_memory_bytes: int,
          watch: Optional[Callable[[], Optional[str]]]) -> None:
  """Reads output and info until both pipes close or the call is stopped (`w.stopped`)."""
  next_memory = time.monotonic()
  # The workspace was checked after the last call: the first walk can wait a poll period.
  next_watch = next_memory + _WATCH_POLL_S
  with selectors.DefaultSelector() as sel:
    for what, fd in (*w.out_r.items(), ("info", w.fds.info_r)):
      sel.register(fd, selectors.EVENT_READ, what)
    while sel.get_map() and w.stopped is None:
      now = time.monotonic()
      if now >= deadline:
        w.stopped = "wall"
        break
      if w.pid1 is not None and now >= next_memory:
        if _over_memory(w, max_memory_bytes):
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
          _on_read(w, key.data, chunk, max_output_bytes)


def _reap(w: _Watch, deadline: float) -> None:
  """Waits for bwrap's exit (killing the sandbox at the deadline) and for PID 1's."""
  if w.stopped is None:
    w.returncode = w.launcher.wait(max(deadline - time.monotonic(), 0.0))
    if w.returncode is None:
      w.stopped = "wall"
  if w.returncode is None:
    w.kill()
  if w.pid1_fd is not None:  # bwrap reaps PID 1 before it exits; this just makes it certain
    waiter = select.poll()
    waiter.register(w.pid1_fd, select.POLLIN)
    waiter.poll(5000)


def run_bwrap(argv: list[str], fds: CallFds, *, wall_s: float, max_output_bytes: int,
              max_memory_bytes: int, launcher: Optional[Launcher] = None,
              run_as: Optional[int] = None, rlimits: Sequence[tuple[int, int, int]] = (),
              watch: Optional[Callable[[], Optional[str]]] = None) -> Completed:
  """Runs argv (through `launcher`, or a one-off launcher with no cgroup), capturing at most
  max_output_bytes of stdout+stderr. argv names fds by the CHILD_*_FD numbers; the launcher
  starts it as uid `run_as` (if given) with `rlimits`.

  Kills the sandbox at wall_s, at the output cap, when its memory goes over max_memory_bytes
  (the kernel does it in the launcher's cgroup; otherwise polled every _MEMORY_POLL_S), or
  when `watch()` (polled every _WATCH_POLL_S) names a limit. Returns only after the sandbox's
  PID 1, hence every process of the call, has exited; if anything here raises, the sandbox is
  killed before the exception propagates (and a launcher that lost track is closed).
  """
  if not (isinstance(wall_s, (int, float)) and math.isfinite(wall_s) and wall_s > 0):
    raise ValueError(f"run_bwrap: wall_s must be a finite positive number, got {wall_s!r}")
  if launcher is None:
    with contextlib.closing(Launcher()) as one_off:
      return run_bwrap(argv, fds, wall_s=wall_s, max_output_bytes=max_output_bytes,
                       max_memory_bytes=max_memory_bytes, launcher=one_off, run_as=run_as,
                       rlimits=rlimits, watch=watch)
  deadline = time.monotonic() + wall_s
  w = _start(argv, fds, launcher, run_as, rlimits)
  try:
    _pump(w, deadline, max_output_bytes, max_memory_bytes, watch)
    try:
      _reap(w, deadline)
    except LauncherError:
      if not launcher.exited(_KILL_GRACE_S):
        raise
      _after_lost_launcher(w)
  except BaseException:
    _kill_after_error(w)  # never leave a sandbox running behind an exception
    raise
  finally:
    w.close()
  returncode = w.returncode
  if returncode < 0:  # bwrap itself killed by a signal: shell convention
    returncode = 128 - returncode
  oom = launcher.group is not None and launcher.group.oom_kills() > w.oom_base
  known = ("wall", "output", "memory")
  return Completed(returncode, bytes(w.bufs["stdout"]), bytes(w.bufs["stderr"]),
                   w.stopped == "wall", w.stopped == "output", w.stopped == "memory" or oom,
                   w.stopped if w.stopped not in known and w.stopped is not None else None)


def _kill_after_error(w: _Watch) -> None:
  """Kills the sandbox behind an exception, reading bwrap's exit status so the launcher is
  ready for the next call; a launcher that cannot say is closed (and bwrap waited for)."""
  if w.returncode is not None:
    return
  try:
    w.kill()
  except (LauncherError, OSError, ValueError):
    _sigkill(w.child.pidfd)
    w.launcher.close()
    select.select([w.child.pidfd], [], [], _REAP_TIMEOUT_S)  # bwrap's own exit, at least
