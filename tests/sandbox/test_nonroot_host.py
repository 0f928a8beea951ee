"""Adversarial: the host side holds when the harness is not root.

Class "host side, as a non-root harness would run". A non-root harness runs the code under its
own uid, so the agent owns what it makes and can strip the owner's permission bits; root
bypasses them. Each scenario (`hostside_cases`) runs with a root harness in-process and, as an
unprivileged harness, in a subprocess dropped to uid 65534 (no capabilities, no cgroup: the
memory cap is then polled).
"""

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
from sandbox_helpers import NOBODY, run_unprivileged

import hostside_cases
from bat_jax.sandbox import launcher as launcher_lib
from bat_jax.sandbox import cgroup, load_evidence, process, safe_fs, workspace

HARNESSES = ["root", "unprivileged"]


@pytest.fixture
def base():
  """A scratch folder the unprivileged uid can reach (pytest's own are root-only)."""
  path = Path(tempfile.mkdtemp(prefix="bat-nonroot-", dir="/tmp"))
  if os.geteuid() == 0:
    os.chown(path, NOBODY, NOBODY)
  yield path
  safe_fs.remove_tree_quietly(path)


def _run(harness: str, case: str, base: Path) -> dict:
  if harness == "root":
    if os.geteuid() != 0:
      pytest.skip("the root harness needs root")
    return getattr(hostside_cases, case)(str(base))
  here = os.path.dirname(os.path.abspath(__file__))
  script = (f"import json, sys\nsys.path.insert(0, {here!r})\nimport hostside_cases\n"
            f"print(json.dumps(hostside_cases.{case}({str(base)!r})))")
  return run_unprivileged(script, str(base))


def _cleaned(after: dict) -> None:
  assert after["in_place"] and after["stage_empty"] and after["removed"], after
  assert after["next_exit"] == 0 and after["next_out"] == "42\n", \
      f"next call: exit {after['next_exit']}, limit {after['next_limit']}: " \
      f"{after['next_observation']!r}"


@pytest.mark.parametrize("harness", HARNESSES)
def test_disk_cap_counts_folders_made_unreadable(require_bwrap, base, harness):
  results = _run(harness, "hide_from_disk_cap", base)
  assert set(results) == set(hostside_cases.HIDE)
  for name, r in results.items():
    assert r["limit"] == "workspace" and r["recorded"] == "workspace", (name, r)
    assert not r["timed_out"] and not r["hidden_left"], (name, r)  # caught during the call
    _cleaned(r)


@pytest.mark.parametrize("harness", HARNESSES)
def test_a_stripped_workspace_is_restored_and_removed(require_bwrap, base, harness):
  results = _run(harness, "strip_permissions", base)
  assert set(results) == set(hostside_cases.STRIP)
  for name, r in results.items():
    assert r["limit"] is None, (name, r)
    _cleaned(r)


@pytest.mark.parametrize("harness", HARNESSES)
def test_a_shared_memory_cap_hit_is_a_call_result(require_bwrap, base, harness):
  results = _run(harness, "memory_via_shared_memory", base)
  after = results.pop("after")
  for name, r in results.items():
    assert r == {"limit": "memory", "timed_out": False, "recorded": "memory"}, (name, r)
  _cleaned(after)


def test_what_cannot_be_measured_counts_as_over_the_cap(base):
  """A folder the harness can neither read nor give its bits back (not its own) ends the walk
  as a limit, never as an empty folder."""
  ws = base / "ws"
  (ws / "locked").mkdir(parents=True)
  (ws / "locked" / "big").write_bytes(b"x" * 4096)
  os.chmod(ws / "locked", 0)
  script = ("import json\nfrom bat_jax.sandbox import workspace\n"
            f"s = workspace.scan(__import__('pathlib').Path({str(ws)!r}))\n"
            "print(json.dumps([s.limit, s.total_bytes]))")
  os.chown(ws, NOBODY, NOBODY)  # the workspace is the harness's; "locked" stays root's
  assert run_unprivileged(script, str(ws)) == ["workspace_unreadable", 0]
  assert workspace.scan(ws).limit is None  # root reads it


def test_restoring_bits_never_follows_a_link(tmp_path):
  target = tmp_path / "host_file"
  target.write_text("x")
  os.chmod(target, 0o400)
  (tmp_path / "ws").mkdir()
  os.symlink(target, tmp_path / "ws" / "link")
  fd = os.open(tmp_path / "ws", os.O_RDONLY | os.O_DIRECTORY)
  try:
    safe_fs.restore_owner_bits(fd, "link")
  finally:
    os.close(fd)
  assert os.stat(target).st_mode & 0o777 == 0o400


# -- the launcher and the OOM killer (root harness with a memory cgroup) -----------------------

@pytest.fixture
def cgroup_sandbox(make_sandbox):
  if not cgroup.available():
    pytest.skip("no writable memory cgroup here")
  return make_sandbox(hostside_cases.MEM)


_MEMFD_THEN_SLEEP = hostside_cases.MEMORY["memfd_then_exec_sleep"]


def test_a_launcher_the_oom_killer_may_take_survives(cgroup_sandbox, monkeypatch):
  """A non-root harness cannot exempt its launcher from the OOM killer; the call's processes
  are its first choice instead."""
  monkeypatch.setattr(launcher_lib, "_OOM_SCORE_ADJ_MIN", 0)  # what a non-root harness gets
  sb = cgroup_sandbox
  assert sb.execute("bash", "true").exit_code == 0
  pid = sb.launcher.pid
  r = sb.execute("python", _MEMFD_THEN_SLEEP)
  assert r.limit_hit == "memory" and not r.timed_out, (r.limit_hit, r.stderr[-300:])
  assert sb.launcher.pid == pid and sb.launcher.alive()


def test_a_launcher_killed_by_the_oom_killer_is_replaced(cgroup_sandbox, monkeypatch):
  """The OOM killer takes the launcher itself (as cgroup v2's group kill does for a non-root
  harness): the call still returns, marked as a memory-limit hit, and the next call gets a new
  launcher."""
  monkeypatch.setattr(launcher_lib, "_OOM_SCORE_ADJ_MIN", 1000)
  monkeypatch.setattr(launcher_lib, "CALL_OOM_SCORE_ADJ", 0)
  sb = cgroup_sandbox
  assert sb.execute("bash", "true").exit_code == 0
  old = sb.launcher
  t0 = time.monotonic()
  r = sb.execute("python", _MEMFD_THEN_SLEEP)
  assert r.limit_hit == "memory" and r.exit_code == 137 and not r.timed_out, r
  assert f"memory limit of {hostside_cases.MEM.memory_mb} MB hit" in r.observation
  assert time.monotonic() - t0 < 15.0
  assert not old.alive()
  assert load_evidence(sb.evidence_path)[-1].limit_hit == "memory"
  r = sb.execute("bash", "cat data/input.txt")
  assert r.exit_code == 0 and r.stdout == "42\n" and sb.launcher is not old


def test_a_launcher_lost_without_an_oom_kill_is_still_an_error(make_sandbox, monkeypatch):
  monkeypatch.setattr(process, "host_oom_kills", lambda: 0)
  sb = make_sandbox()
  assert sb.execute("bash", "true").exit_code == 0
  pid = sb.launcher.pid
  os.kill(pid, 0)

  def kill_launcher() -> None:
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)

  threading.Thread(target=kill_launcher, daemon=True).start()
  with pytest.raises(launcher_lib.LauncherError, match="no OOM kill explains it"):
    sb.execute("bash", "sleep 2.5")
  assert load_evidence(sb.evidence_path)[-1].limit_hit == "harness_error"
  assert sb.execute("bash", "cat data/input.txt").stdout == "42\n"
