"""The escape suite: every attempt is contained, the observation says so, the host is untouched.

Each test plants a canary OUTSIDE the workspace and checks it after the call, and checks that no
process of the call outlives it.
"""

import dataclasses
import hashlib
import os
import signal
import socket
import threading
import time

import pytest
from sandbox_helpers import FAST, processes_of, processes_running

from bat_jax import workflow
from bat_jax.sandbox import materialize, seccomp


@pytest.fixture
def canary(tmp_path):
  """A host file (and folder) outside the workspace; asserts both untouched at teardown."""
  host = tmp_path / "host"
  host.mkdir()
  path = host / "canary.txt"
  path.write_text("host canary 8f3a")
  yield path
  assert path.read_text() == "host canary 8f3a"
  assert sorted(os.listdir(host)) == ["canary.txt"]


def _no_strays(sb):
  if sb.host_uid is not None:
    assert processes_of(sb.host_uid) == []


def test_read_outside_workspace(make_sandbox, canary):
  sb = make_sandbox()
  r = sb.execute("bash", f"cat {canary}; ls /root; ls /work; cat /etc/shadow; ls {canary.parent}")
  assert r.exit_code != 0
  assert "host canary" not in r.observation
  assert f"cat: {canary}: No such file or directory" in r.stderr
  assert "ls: cannot access '/root': No such file or directory" in r.stderr
  assert "ls: cannot access '/work'" in r.stderr
  assert "cat: /etc/shadow: Permission denied" in r.stderr
  # Private /proc: only the call's own processes are visible, no host process.
  r = sb.execute("bash", "ls /proc | grep -c '^[0-9]'; ls /sys 2>&1 | head -1")
  assert int(r.stdout.split()[0]) < 10 and "No such file" in r.stdout
  # Relative escapes land in the sandbox's own tmpfs root, not the host folder.
  r = sb.execute("python", "print(open('../host/canary.txt').read())")
  assert r.exit_code == 1 and "FileNotFoundError" in r.stderr
  _no_strays(sb)


def test_write_outside_workspace(make_sandbox, canary, tmp_path):
  sb = make_sandbox()
  code = "\n".join(
      f"echo pwned > {p} 2>/dev/null && echo WROTE {p}" for p in
      (canary, "/usr/pwned", "/etc/pwned", "/pwned", "../pwned", f"{tmp_path}/pwned"))
  scratch = f"/tmp/bat-sandbox-scratch-{os.getpid()}"
  r = sb.execute("bash", code + f"\necho scratch > {scratch} && echo TMP_OK")
  assert "WROTE" not in r.stdout
  assert "TMP_OK" in r.stdout  # /tmp is writable, but private (a tmpfs)
  assert not os.path.exists(scratch)
  assert not (tmp_path / "pwned").exists()
  assert not os.path.exists("/usr/pwned") and not os.path.exists("/etc/pwned")
  r = sb.execute("bash", f"cat {scratch}")  # each call gets a fresh /tmp
  assert r.exit_code == 1 and "No such file" in r.stderr
  _no_strays(sb)


def test_symlink_escape(make_sandbox, canary):
  sb = make_sandbox()
  r = sb.execute("bash", f"ln -s {canary} abs_link && ln -s ../host rel_link && "
                          f"ln -s {canary.parent} dir_link && echo linked\n"
                          "echo pwned > abs_link; echo pwned > rel_link/canary.txt; "
                          "echo pwned > dir_link/new.txt; cat abs_link")
  assert "linked" in r.stdout and r.exit_code != 0
  assert "host canary" not in r.observation
  # The harness must not follow the links either: fingerprint records the links themselves...
  changed = sb.evidence[-1].changed
  assert set(changed) == {"abs_link", "rel_link", "dir_link"}
  assert hashlib.sha256(b"host canary 8f3a").hexdigest() not in changed.values()
  # ...and materialize replaces a link or refuses to write through one.
  materialize({"abs_link": "replaced"}, sb.workspace)
  with pytest.raises(ValueError, match="symlink"):
    materialize({"dir_link/canary.txt": "pwned"}, sb.workspace)
  _no_strays(sb)


def test_network_connect_fails(make_sandbox):
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  server.settimeout(0.5)
  port = server.getsockname()[1]
  accepted = []
  stop = threading.Event()

  def accept():
    while not stop.is_set():
      try:
        accepted.append(server.accept())
      except socket.timeout:
        pass

  t = threading.Thread(target=accept)
  t.start()
  try:
    # Sanity: the server is reachable from the host.
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    time.sleep(0.2)
    n_host = len(accepted)
    assert n_host == 1
    sb = make_sandbox()
    r = sb.execute("python", f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)"
                             "\nprint('CONNECTED')")
    assert r.exit_code == 1 and "CONNECTED" not in r.stdout
    assert "ConnectionRefusedError" in r.stderr or "unreachable" in r.stderr
    r = sb.execute("python", "import socket\nsocket.create_connection(('1.1.1.1', 53), 2)")
    assert r.exit_code == 1 and "unreachable" in r.stderr
    time.sleep(0.2)
    assert len(accepted) == n_host  # nothing from the sandbox reached the host server
  finally:
    stop.set()
    t.join()
    for conn, _ in accepted:
      conn.close()
    server.close()
  _no_strays(sb)


def test_fork_bomb(make_sandbox):
  sb = make_sandbox()
  t0 = time.monotonic()
  # The shell stays (sleep, not `wait`): `wait` returned once its own job's two subshells had
  # forked theirs, and a shell that left before any fork failed hit no limit (seen under load).
  r = sb.execute("bash", "bomb() { bomb | bomb & }; bomb; sleep 30")
  assert time.monotonic() - t0 < FAST.wall_s + 3
  assert r.limit_hit in ("procs", "wall")
  assert "[sandbox]" in r.observation and "limit" in r.observation
  _no_strays(sb)
  r = sb.execute("python", "import os, time\nwhile True:\n  if os.fork() == 0: time.sleep(60)")
  assert r.limit_hit == "procs" and "BlockingIOError" in r.stderr
  assert f"process limit of {FAST.max_procs} processes hit" in r.observation
  _no_strays(sb)
  assert sb.execute("bash", "echo alive").stdout == "alive\n"  # the next call is unaffected


def test_memory_bomb(make_sandbox):
  sb = make_sandbox()
  r = sb.execute("python", "x = bytearray(2 << 30)")
  assert (r.exit_code, r.limit_hit) == (1, "memory")
  assert f"memory limit of {FAST.memory_mb} MB hit" in r.observation
  r = sb.execute("python", "chunks = []\nwhile True: chunks.append(b'x' * (8 << 20))")
  assert r.limit_hit == "memory" and "MemoryError" in r.stderr
  _no_strays(sb)
  # Many processes, each under the per-process cap, together over it: the tree is killed
  # (a generous wall limit, so only the memory watchdog can stop it on a loaded machine).
  sb = make_sandbox(dataclasses.replace(FAST, wall_s=15.0))
  t0 = time.monotonic()
  r = sb.execute("python", "import os, time\n"
                           "for _ in range(8):\n"
                           "  if os.fork() == 0:\n"
                           "    x = b'x' * (100 << 20); time.sleep(30)\n"
                           "time.sleep(30)")
  assert r.limit_hit == "memory" and not r.timed_out and r.exit_code == 137
  assert time.monotonic() - t0 < 15.0
  assert f"memory limit of {FAST.memory_mb} MB hit" in r.observation
  _no_strays(sb)


def test_infinite_loop_cpu_and_wall(make_sandbox):
  # A wall limit far above the CPU one, so RLIMIT_CPU fires first even on a loaded machine.
  sb = make_sandbox(dataclasses.replace(FAST, cpu_s=1, wall_s=20.0))
  t0 = time.monotonic()
  r = sb.execute("python", "while True: pass")
  assert r.limit_hit == "cpu" and not r.timed_out and r.exit_code == 128 + signal.SIGXCPU
  assert "CPU-time limit of 1 s hit" in r.observation
  assert time.monotonic() - t0 < 20.0
  sb = make_sandbox()
  t0 = time.monotonic()
  r = sb.execute("bash", "echo started; sleep 1000")  # idle: the wall limit fires
  assert r.timed_out and r.limit_hit == "wall" and r.exit_code == 137
  assert r.stdout == "started\n"
  assert "wall-time limit of 3 s hit" in r.observation
  assert FAST.wall_s <= time.monotonic() - t0 < FAST.wall_s + 2
  assert sb.evidence[-1].timed_out
  _no_strays(sb)
  assert processes_running("sleep 1000") == []


def test_huge_output(make_sandbox):
  sb = make_sandbox()
  r = sb.execute("bash", "yes y-y-y-y-y-y-y-y")
  assert r.limit_hit == "output"
  assert len(r.stdout.encode()) <= FAST.max_output_bytes
  assert len(r.observation) <= workflow.MAX_OBSERVATION_CHARS
  assert "output limit of 65536 bytes hit" in r.observation
  r = sb.execute("python", "import sys\nsys.stdout.write('z' * (50 << 20))")  # one big write
  assert r.limit_hit == "output" and len(r.stdout) <= FAST.max_output_bytes
  _no_strays(sb)


def test_background_process_is_gone_after_the_call(make_sandbox):
  sb = make_sandbox()
  t0 = time.monotonic()
  r = sb.execute("bash", "(sleep 3; echo late > late.txt) & nohup sleep 997 >/dev/null 2>&1 & "
                          "setsid sleep 998 & disown; echo started")
  assert r.exit_code == 0 and r.stdout == "started\n"
  assert time.monotonic() - t0 < 2.5  # the call did not wait for its children
  assert processes_running("sleep 997") == [] and processes_running("sleep 998") == []
  _no_strays(sb)
  time.sleep(max(0.0, t0 + 3.5 - time.monotonic()))
  assert not (sb.workspace / "late.txt").exists()  # the child died before it could write


def test_workspace_size_cap(make_sandbox):
  sb = make_sandbox()
  r = sb.execute("bash", "head -c 20M /dev/zero > big.bin")  # one file over the cap
  assert r.limit_hit == "workspace" and "workspace size limit of 8 MB hit" in r.observation
  assert not (sb.workspace / "big.bin").exists()  # over the cap: what the call wrote is gone
  r = sb.execute("bash", "for i in 1 2 3; do head -c 5M /dev/zero > part$i.bin; done")
  assert r.limit_hit == "workspace"  # many files under the per-file cap
  assert not list(sb.workspace.glob("part*")) and sb.evidence[-1].limit_hit == "workspace"


def test_no_new_user_namespaces(make_sandbox):
  sb = make_sandbox()
  r = sb.execute("bash", "unshare --user --map-root-user id")
  assert r.exit_code != 0 and "Operation not permitted" in r.stderr
  assert "uid=0" not in r.stdout
  # Ordinary clone()s (threads, subprocesses) are still allowed.
  r = sb.execute("python", "import subprocess, threading\n"
                           "t = threading.Thread(target=print, args=('thread',))\n"
                           "t.start(); t.join()\n"
                           "out = subprocess.run(['echo', 'child'], capture_output=True)\n"
                           "print(out.stdout.decode())")
  assert r.exit_code == 0 and r.stdout.split() == ["thread", "child"]


def test_seccomp_filter_refuses_unknown_machines():
  assert len(seccomp.no_userns_filter("x86_64")) % 8 == 0  # whole struct sock_filter entries
  assert seccomp.no_userns_filter("x86_64") != seccomp.no_userns_filter("aarch64")
  with pytest.raises(ValueError, match="'riscv64'"):
    seccomp.no_userns_filter("riscv64")
