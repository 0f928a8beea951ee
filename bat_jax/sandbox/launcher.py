"""The harness's end of a sandbox launcher (`launcher_main.py`): start it, run calls, stop it.

A `Sandbox` keeps one launcher, moved into its memory cgroup once, so each call's bwrap is
forked inside the group (a cgroup-v1 migration per call cost 1-8 ms) and gets the call's
rlimits before it starts (no `prlimit` exec inside the sandbox).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from bat_jax.sandbox import cgroup

_MAIN = Path(__file__).with_name("launcher_main.py")
_REPLY_BYTES = 4096
# How long a healthy launcher may take to fork (it does nothing else meanwhile).
_START_TIMEOUT_S = 30.0
_OOM_SCORE_ADJ_MIN = -1000
# Every call's processes: the OOM killer's first choice, before the launcher and the harness
# (which a non-root harness cannot exempt).
CALL_OOM_SCORE_ADJ = 1000


class LauncherError(RuntimeError):
  """The launcher died or broke the protocol; the call did not run (or its status is lost)."""


@dataclasses.dataclass
class Child:
  """One started bwrap: its host pid and a pidfd (owned: `Launcher.finish` closes it)."""
  pid: int
  pidfd: int


class Launcher:
  """A launcher process, in `group` when given (the group is then this launcher's: `close`
  removes it)."""

  def __init__(self, group: Optional[cgroup.MemoryCgroup] = None):
    self.group = group
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
      self._proc = subprocess.Popen(
          [sys.executable, "-I", "-S", str(_MAIN), str(theirs.fileno())],
          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
          start_new_session=True, env={})
    except BaseException:
      ours.close()
      if group is not None:
        group.remove()
      raise
    finally:
      theirs.close()
    self._sock = ours
    self._owner = os.getpid()  # a forked copy of the harness must not use or stop it
    try:
      try:  # root only: an OOM in the group then kills the call, never the launcher
        Path(f"/proc/{self._proc.pid}/oom_score_adj").write_text(str(_OOM_SCORE_ADJ_MIN))
      except OSError:
        pass
      if group is not None:
        group.add(self._proc.pid)
    except BaseException:
      self.close()
      raise

  @property
  def pid(self) -> int:
    """The launcher process's pid."""
    return self._proc.pid

  def alive(self) -> bool:
    """Running, and this process's (not a forked copy's)."""
    return os.getpid() == self._owner and self._proc.poll() is None

  def exited(self, timeout: float) -> bool:
    """Whether the launcher process has exited (waiting up to `timeout` for it to)."""
    try:
      self._proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      return False
    return True

  def start(self, argv: Sequence[str], stdout: int, stderr: int, extra_fds: Sequence[int], *,
            run_as: Optional[int] = None,
            rlimits: Sequence[tuple[int, int, int]] = ()) -> Child:
    """Forks argv with fds 1, 2 = stdout, stderr and 3, 4, ... = extra_fds, as uid and gid
    run_as (no supplementary groups) when given, with rlimits; returns the child.

    Raises:
      LauncherError: the launcher is gone or did not answer.
    """
    head = json.dumps({"run_as": run_as, "rlimits": [list(r) for r in rlimits],
                       "oom_score_adj": CALL_OOM_SCORE_ADJ}).encode()
    body = head + b"\n" + b"\0".join(os.fsencode(a) for a in argv)
    try:
      socket.send_fds(self._sock, [body], [stdout, stderr, *extra_fds])
      self._sock.settimeout(_START_TIMEOUT_S)
      try:
        msg, fds, _, _ = socket.recv_fds(self._sock, _REPLY_BYTES, 1)
      finally:
        self._sock.settimeout(None)
    except OSError as e:  # includes a timeout
      raise LauncherError(f"sandbox launcher (pid {self._proc.pid}) failed: {e!r}") from e
    if not msg or len(fds) != 1:
      for fd in fds:
        os.close(fd)
      raise LauncherError(f"sandbox launcher (pid {self._proc.pid}) exited or answered "
                          f"{msg[:80]!r}")
    return Child(json.loads(msg)["pid"], fds[0])

  def wait(self, timeout: Optional[float]) -> Optional[int]:
    """The exit code of the started child (-N: killed by signal N), None at the timeout."""
    if not select.select([self._sock], [], [], timeout)[0]:
      return None
    try:
      msg = self._sock.recv(_REPLY_BYTES)
    except OSError as e:
      raise LauncherError(f"sandbox launcher (pid {self._proc.pid}) failed: {e!r}") from e
    if not msg:
      raise LauncherError(f"sandbox launcher (pid {self._proc.pid}) exited during a call")
    return int(json.loads(msg)["status"])

  def close(self) -> None:
    """Stops the launcher (EOF: it kills a running call and exits) and removes its group;
    in a forked copy of the harness, only closes that copy's socket."""
    self._sock.close()
    if os.getpid() != self._owner:
      return
    try:
      self._proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
    if self.group is not None:
      self.group.remove()
