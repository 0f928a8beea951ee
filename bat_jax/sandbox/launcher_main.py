"""The sandbox launcher process (run as `python -I -S launcher_main.py FD`; stdlib only).

One runs per `Sandbox`, moved into its memory cgroup once: every call's bwrap is forked from
here, so it is born inside the group and no call pays a cgroup migration. It serves one call
at a time over the SOCK_SEQPACKET socket FD:

  request  JSON {"run_as": uid or null, "rlimits": [[resource, soft, hard], ...],
           "oom_score_adj"}, a newline, then
           argv as NUL-separated bytes (argv holds no NUL; no escaping, so 120 kB of code fits
           one message), with fds [stdout, stderr, *extra] attached; the child gets them as
           1, 2, 3, ... (0 is /dev/null)
  replies  {"pid"} with the child's pidfd attached, then {"status"} (exit code; -N: signal N)

The child leads a new session, takes the rlimits (inherited by everything bwrap starts), drops
to uid and gid `run_as` with no supplementary groups (as root; bwrap then makes a user
namespace for that uid), and takes the OOM score it is sent (the highest: the call is the OOM
killer's first choice; a root launcher is also exempt, so an OOM in the group kills the call,
never the launcher). When the harness goes away (EOF on the socket, or
anything arriving mid-call), the running call is SIGKILLed and the launcher exits. It is a
child subreaper, so it reaps whatever of a call outlives bwrap before it reports the status.
"""

import ctypes
import fcntl
import json
import os
import resource
import select
import signal
import socket
import sys

_PR_SET_CHILD_SUBREAPER = 36


def _child(request: dict, argv: list, fds: list) -> None:
  """In the forked child: fds into place, limits, then exec. Never returns."""
  try:
    os.setsid()
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in fds]  # clear of every target
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    for target, fd in enumerate(moved, start=1):
      os.dup2(fd, target)
    os.closerange(len(moved) + 1, 1 << 20)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; exec would keep that
      signal.signal(sig, signal.SIG_DFL)
    try:
      with open("/proc/self/oom_score_adj", "w") as f:
        f.write(str(request["oom_score_adj"]))
    except OSError:
      pass
    for res, soft, hard in request["rlimits"]:
      resource.setrlimit(res, (soft, hard))
    uid = request["run_as"]
    if uid is not None:
      os.setgroups([])
      os.setresgid(uid, uid, uid)
      os.setresuid(uid, uid, uid)
    os.execve(argv[0], argv, {"PATH": "/usr/bin:/bin"})
  except BaseException as e:  # pylint: disable=broad-except
    try:
      os.write(2, f"sandbox launcher: cannot start {argv[:1]}: {e}\n".encode())
    finally:
      os._exit(127)


def _reap_orphans() -> None:
  """Waits for what bwrap left (a PID 1 whose bwrap was killed first, e.g. by the OOM killer,
  re-parents here: it dies of bwrap's --die-with-parent)."""
  while True:
    try:
      os.waitpid(-1, 0)
    except ChildProcessError:
      return


def _serve_one(sock: socket.socket, msg: bytes, fds: list) -> bool:
  """Runs one call; False when the harness went away (the call is then killed)."""
  head, _, tail = msg.partition(b"\n")
  request, argv = json.loads(head), tail.split(b"\0")
  pid = os.fork()
  if pid == 0:
    _child(request, argv, fds)
  for fd in fds:
    os.close(fd)
  pidfd = os.pidfd_open(pid)
  try:
    socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(sock, select.POLLIN)
    while True:
      ready = dict(poller.poll())
      if sock.fileno() in ready:  # EOF or a stray message mid-call: the harness is gone
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.waitpid(pid, 0)
        _reap_orphans()
        return False
      if pidfd in ready:
        break
    _, status = os.waitpid(pid, 0)
    _reap_orphans()
    sock.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
    return True
  finally:
    os.close(pidfd)


def main() -> None:
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=int(sys.argv[1]))
  # A child subreaper: orphans of a call re-parent here, not to a host init that may not reap.
  ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
  while True:
    try:
      msg, fds, flags, _ = socket.recv_fds(sock, 1 << 20, 16)
    except OSError:
      return
    if not msg or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
      return  # EOF, or a message cut short: nothing safe to run
    if not _serve_one(sock, msg, fds):
      return


if __name__ == "__main__":
  main()
