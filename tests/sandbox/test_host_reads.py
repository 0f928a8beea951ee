"""Adversarial: what the harness does with agent-made files, during and after a call.

Class "host reads of agent-made files". The first group attacks `safe_fs` directly (no sandbox,
milliseconds); the second plants the same things from inside a real sandbox call and checks the
call is recorded, bounded and cleaned up. Every attack is bounded in time and size.
"""

import dataclasses
import json
import os
import socket
import threading
import time

import pytest
from sandbox_helpers import FAST

from bat_jax.evaluator import episode
from bat_jax.sandbox import bwrap, load_evidence, safe_fs
from bat_jax.sandbox import workspace as workspace_lib


def _bounded(fn, seconds=5.0):
  """Runs fn in a thread; fails the test if it has not returned within `seconds`."""
  out = {}

  def run():
    try:
      out["value"] = fn()
    except BaseException as e:  # noqa: BLE001 - the test inspects it
      out["error"] = e
  t = threading.Thread(target=run, daemon=True)
  t.start()
  t.join(seconds)
  assert not t.is_alive(), f"{fn} blocked for more than {seconds} s"
  return out


@pytest.fixture(autouse=True)
def _flat_cleanup(tmp_path):
  """Deep trees are removed here: pytest's own cleanup (shutil.rmtree) recurses and would fail
  on them in a later session, for every user of the shared basetemp."""
  yield
  safe_fs.remove_tree(tmp_path)


@pytest.fixture
def ws(tmp_path):
  root = tmp_path / "ws"
  (root / "sub").mkdir(parents=True)
  (root / "sub" / "ok.txt").write_text("fine")
  (tmp_path / "answers.txt").write_text("host secret answers")
  return root


@pytest.mark.parametrize("plant,rel", [
    (lambda r, t: os.symlink(t / "answers.txt", r / "abs_link"), "abs_link"),
    (lambda r, t: os.symlink("../answers.txt", r / "rel_link"), "rel_link"),
    (lambda r, t: os.symlink("/dev/zero", r / "zero"), "zero"),
    (lambda r, t: os.symlink(t, r / "dirlink"), "dirlink/answers.txt"),
    (lambda r, t: os.symlink("/proc/self/environ", r / "env"), "env"),
    (lambda r, t: os.mkfifo(r / "fifo"), "fifo"),
    (lambda r, t: os.mkdir(r / "adir"), "adir"),
    (lambda r, t: None, "../answers.txt"),
    (lambda r, t: None, "/etc/passwd"),
    (lambda r, t: None, "sub/../../answers.txt"),
], ids=["abs_symlink", "relative_dotdot_symlink", "dev_zero", "dir_symlink_on_the_way",
        "proc_link", "fifo", "folder", "dotdot_path", "absolute_path", "dotdot_inside"])
def test_safe_read_refuses(ws, tmp_path, plant, rel):
  plant(ws, tmp_path)
  out = _bounded(lambda: safe_fs.read_bytes(ws, rel, 1 << 20))
  assert isinstance(out.get("error"), OSError) and "value" not in out


def test_safe_read_refuses_unix_socket_and_oversize(ws):
  with socket.socket(socket.AF_UNIX) as s:
    s.bind(str(ws / "sock"))
    assert isinstance(_bounded(lambda: safe_fs.read_bytes(ws, "sock"))["error"], OSError)
  (ws / "big").write_bytes(b"x" * 5000)
  with pytest.raises(safe_fs.UnsafeFileError, match="over the 4096-byte cap"):
    safe_fs.read_bytes(ws, "big", 4096)
  assert safe_fs.read_bytes(ws, "sub/ok.txt") == b"fine"
  assert safe_fs.kind(ws, "sub/ok.txt") == "file" and safe_fs.kind(ws, "missing") is None


def _deep(root, depth, name="d"):
  fd = os.open(root, os.O_RDONLY)
  try:
    for _ in range(depth):
      os.mkdir(name, dir_fd=fd)
      nxt = os.open(name, os.O_RDONLY, dir_fd=fd)
      os.close(fd)
      fd = nxt
    os.close(os.open("leaf", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
  finally:
    os.close(fd)


def test_walks_are_bounded_not_recursive(ws):
  _deep(ws, 1200)  # deeper than the interpreter's recursion limit
  found = workspace_lib.scan(ws)
  assert found.limit == "workspace_depth" and found.fp["sub/ok.txt"]
  for i in range(300):
    (ws / f"f{i:04d}").touch()
  assert workspace_lib.scan(ws, safe_fs.WalkBudget(max_entries=200)).limit == "workspace_entries"
  assert workspace_lib.scan(ws, safe_fs.WalkBudget(max_bytes=2)).limit == "workspace_bytes"


def test_remove_tree_survives_deep_long_odd_and_locked_trees(tmp_path):
  root = tmp_path / "junk"
  root.mkdir()
  _deep(root, 1200)                       # 1,200 levels
  _deep(root, 40, name="n" * 250)         # a path of ~10,000 bytes, past PATH_MAX
  odd = os.fsencode(root) + b"/\xff\xfe-not-utf8"
  os.mkdir(odd)
  os.mkdir(odd + b"/locked")
  os.chmod(odd + b"/locked", 0)           # no permissions at all
  os.symlink("/etc", root / "etc_link")   # removed as a link, target untouched
  os.mkfifo(root / "fifo")
  t0 = time.monotonic()
  episode.remove_quietly(root)
  assert not root.exists() and os.path.isdir("/etc")
  assert time.monotonic() - t0 < 60


# -- planted from inside a real sandbox call ----------------------------------------------------

def test_deep_tree_is_a_recorded_limit_and_is_removed(make_sandbox):
  sb = make_sandbox()
  r = sb.execute("python", "import os\nfor _ in range(1200):\n  os.mkdir('d'); os.chdir('d')\n")
  assert r.limit_hit == "workspace_depth" and "nested deeper than" in r.observation
  assert not (sb.workspace / "d").exists()
  assert load_evidence(sb.evidence_path)[-1].limit_hit == "workspace_depth"
  r = sb.execute("bash", "cat data/input.txt")
  assert r.exit_code == 0 and r.stdout == "42\n" and r.limit_hit is None


def test_many_files_are_a_recorded_limit_and_later_calls_stay_cheap(make_sandbox, monkeypatch):
  monkeypatch.setattr(bwrap, "_WALK", dataclasses.replace(bwrap._WALK, max_entries=2000))
  sb = make_sandbox(dataclasses.replace(FAST, wall_s=20.0, cpu_s=20))
  r = sb.execute("python", "import os, time\nos.mkdir('m')\n"
                           "for i in range(3000): open(f'm/{i}', 'w').close()\ntime.sleep(30)")
  assert r.limit_hit == "workspace_entries" and not (sb.workspace / "m").exists()
  assert not r.timed_out  # stopped by the in-call watch, not by the wall limit
  t0 = time.monotonic()
  assert sb.execute("bash", "true").exit_code == 0
  assert time.monotonic() - t0 < 5.0  # the 25,000 files do not tax every later call


def test_long_paths_odd_names_and_lone_surrogates_are_recorded(make_sandbox):
  sb = make_sandbox()
  r = sb.execute("python", "import os\nfor _ in range(30):\n  os.mkdir('n' * 250); "
                           "os.chdir('n' * 250)\nopen('leaf', 'w').write('x')\n"
                           "os.chdir('/workspace')\nopen(b'odd-\\xff\\xfe', 'w').write('y')\n")
  assert r.exit_code == 0 and r.limit_hit is None
  rec = load_evidence(sb.evidence_path)[-1]
  assert any(len(rel) > 4096 for rel in rec.changed)           # past PATH_MAX, still recorded
  assert any(rel.startswith("odd-") for rel in rec.changed)    # non-UTF-8 name, still recorded
  r = sb.execute("python", "print('\ud800')")                   # a lone surrogate in the code
  assert r.limit_hit == "code_encoding" and "lone surrogate" in r.observation
  assert load_evidence(sb.evidence_path)[-1].limit_hit == "code_encoding"
  assert len(sb.evidence) == 2


def test_special_files_in_the_workspace_never_block_the_harness(make_sandbox):
  sb = make_sandbox()
  code = ("import os, socket\nos.mkfifo('fifo')\ns = socket.socket(socket.AF_UNIX)\n"
          "s.bind('sock')\nos.symlink('/dev/zero', 'zero')\nos.symlink('fifo', 'fifo_link')\n")
  out = _bounded(lambda: sb.execute("python", code), seconds=20)
  assert out["value"].exit_code == 0
  out = _bounded(lambda: workspace_lib.scan(sb.workspace))
  assert "fifo" not in out["value"].fp and "zero" in out["value"].fp  # links by target only


def test_every_call_is_recorded_even_when_the_harness_fails(make_sandbox, monkeypatch):
  sb = make_sandbox()

  def broken(*a, **k):
    raise OSError("disk went away")
  monkeypatch.setattr(sb, "_run", broken)
  with pytest.raises(OSError, match="disk went away"):
    sb.execute("bash", "true")
  rec = load_evidence(sb.evidence_path)[-1]
  assert rec.limit_hit == "harness_error" and rec.exit_code == -1 and rec.changed == {}
  line = sb.evidence_path.read_text().splitlines()[-1]
  assert json.loads(line)["call_index"] == 0


@pytest.mark.slow
def test_200k_files_at_the_real_budget(make_sandbox):
  """The reported attack at full size: 200,000 empty files. The watch stops it at the real
  entry budget, the files go, and the next call costs what a call costs."""
  sb = make_sandbox(dataclasses.replace(FAST, wall_s=120.0, cpu_s=120))
  r = sb.execute("python", "import os\nos.mkdir('m')\n"
                           "for i in range(200000): open(f'm/{i}', 'w').close()\n")
  assert r.limit_hit == "workspace_entries" and not (sb.workspace / "m").exists()
  t0 = time.monotonic()
  assert sb.execute("bash", "true").exit_code == 0
  assert time.monotonic() - t0 < 3.0
