"""The per-Sandbox launcher and memory cgroup: calls are born in the group, one group serves
every call, a dead launcher is replaced, a dead harness takes its call with it, and the
SETPRIV fallback mode contains as USERNS does."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from sandbox_helpers import FAST, processes_of, processes_running

from bat_jax.sandbox import bwrap, cgroup

MEM = dataclasses.replace(FAST, wall_s=20.0, cpu_s=15, memory_mb=256, max_workspace_mb=512)
_HOG = "b = []\nwhile True: b.append(bytearray(50 << 20))"


def _group_pids(group: cgroup.MemoryCgroup) -> set[int]:
  return {int(p) for p in (group.path / "cgroup.procs").read_text().split()}


def test_calls_are_born_in_the_sandbox_memory_group(make_sandbox, monkeypatch):
  if not cgroup.available():
    pytest.skip("no writable memory cgroup here")
  sb = make_sandbox(MEM)
  assert sb.execute("bash", "true").exit_code == 0
  group = sb.launcher.group
  # Groups made by the call's own thread (other tests' sandboxes in this process may come and
  # go meanwhile, so the cgroup directory listing is not the measure).
  made_by_call: list[str] = []
  make_group = cgroup.MemoryCgroup.__init__

  def spy(self, *args, **kwargs):
    if threading.current_thread() is t:
      made_by_call.append("group")
    make_group(self, *args, **kwargs)
  monkeypatch.setattr(cgroup.MemoryCgroup, "__init__", spy)
  t = threading.Thread(target=lambda: sb.execute("bash", "sleep 1.5"))
  t.start()
  # Poll while the call runs: bwrap forks its PID 1 and the code a moment after the first
  # process of the code's uid appears, so one early snapshot can miss them.
  seen: set[int] = set()
  born_inside = False
  deadline = time.monotonic() + 10
  while t.is_alive() and time.monotonic() < deadline:
    code_now = set(processes_of(sb.host_uid if sb.host_uid is not None else -1))
    group_now = _group_pids(group)  # read after: a code pid seen above is in it by now
    seen |= group_now
    born_inside = born_inside or bool(code_now and code_now <= group_now)
    if len(seen) >= 3 and (born_inside or sb.host_uid is None):
      break
    time.sleep(0.02)
  t.join()
  code_pids = processes_of(sb.host_uid) if sb.host_uid is not None else []
  assert len(seen) >= 3, seen  # the launcher, bwrap, its PID 1, the code
  assert born_inside or sb.host_uid is None
  assert code_pids == []  # all gone after the call
  assert made_by_call == [] and group.path.is_dir()  # no group made per call
  assert sb.launcher.group is group


def test_an_oom_kill_marks_only_its_own_call(make_sandbox):
  if not cgroup.available():
    pytest.skip("no writable memory cgroup here")
  sb = make_sandbox(dataclasses.replace(MEM, memory_mb=2048))
  code = "import mmap\nm = mmap.mmap(-1, 3000 << 20, mmap.MAP_SHARED)\n" \
         "for i in range(0, len(m), 4096): m[i] = 1"
  assert sb.execute("python", code).limit_hit == "memory"
  r = sb.execute("bash", "echo fine")
  assert (r.limit_hit, r.exit_code, r.stdout) == (None, 0, "fine\n")


def test_a_dead_launcher_is_replaced(make_sandbox):
  sb = make_sandbox()
  assert sb.execute("bash", "true").exit_code == 0
  first = sb.launcher
  os.kill(first.pid, signal.SIGKILL)
  deadline = time.monotonic() + 10
  while first.alive() and time.monotonic() < deadline:
    time.sleep(0.01)
  r = sb.execute("bash", "echo again")
  assert (r.exit_code, r.stdout) == (0, "again\n")
  assert sb.launcher is not first


def test_close_stops_the_launcher_and_removes_its_group(make_sandbox):
  sb = make_sandbox()
  assert sb.execute("bash", "true").exit_code == 0
  first = sb.launcher
  sb.close()
  assert not first.alive()
  assert first.group is None or not first.group.path.exists()
  assert sb.execute("bash", "echo back").stdout == "back\n"  # a new launcher


def test_a_killed_harness_takes_its_call_with_it(tmp_path, require_bwrap):
  marker = f"bat-launcher-orphan-{os.getpid()}"
  # The harness's own command line must not hold the marker: it is assembled at run time.
  script = textwrap.dedent(f"""
      from pathlib import Path
      from bat_jax.sandbox import Sandbox, materialize
      materialize({{"a.txt": "1"}}, Path({str(tmp_path)!r}) / "ws")
      sb = Sandbox(Path({str(tmp_path)!r}) / "ws")
      marker = "bat-launcher-" + "orphan-{os.getpid()}"
      sb.execute("bash", f"( trap '' TERM; exec -a {{marker}} sleep 60 ) & sleep 60")
  """)
  harness = subprocess.Popen([sys.executable, "-c", script])
  try:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not processes_running(marker):
      time.sleep(0.05)
    assert processes_running(marker), "the call never started"
    assert harness.pid not in processes_running(marker)
    time.sleep(0.5)  # the background sleep is up too
  finally:
    harness.kill()
    harness.wait()
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and processes_running(marker):
    time.sleep(0.05)
  assert processes_running(marker) == []


def test_setpriv_mode_contains_too(make_sandbox):
  if os.geteuid() != 0:
    pytest.skip("SETPRIV mode is for a root harness")
  sb = make_sandbox()
  sb.mode = bwrap.SETPRIV
  r = sb.execute("bash", "id -u; grep CapEff /proc/self/status; "
                         "for p in /pwned /usr/pwned /etc/pwned; do echo x > $p && echo WROTE; done")
  lines = r.stdout.split("\n")
  assert lines[0] == str(sb.host_uid) and lines[1].endswith("0000000000000000"), r.stdout
  assert "WROTE" not in r.stdout
  r = sb.execute("python", "import os, time\nwhile True:\n  if os.fork() == 0: time.sleep(60)")
  assert r.limit_hit == "procs", r.stderr[-300:]
  assert processes_of(sb.host_uid) == []


def test_a_forked_harness_gets_its_own_launcher(make_sandbox):
  sb = make_sandbox()
  assert sb.execute("bash", "true").exit_code == 0
  parent = sb.launcher
  pid = os.fork()
  if pid == 0:  # the child: its own launcher; the parent's is left alone
    ok = sb.execute("bash", "echo child").stdout == "child\n" and sb.launcher is not parent
    sb.close()
    os._exit(0 if ok else 1)
  _, status = os.waitpid(pid, 0)
  assert os.waitstatus_to_exitcode(status) == 0
  assert parent.alive() and sb.execute("bash", "echo parent").stdout == "parent\n"
