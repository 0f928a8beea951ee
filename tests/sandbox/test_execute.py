"""Sandbox.execute: results, observation, evidence, environment, errors."""

import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest
from sandbox_helpers import FAST

from bat_jax import workflow
from bat_jax.sandbox import Sandbox, SandboxUnavailableError, load_evidence, materialize
from bat_jax.sandbox import bwrap as bwrap_lib


def test_python_and_bash_run_in_workspace(make_sandbox):
  sb = make_sandbox()
  r = sb.execute("python", "import os, sys\n"
                 "print(os.getcwd(), sys.executable, open('data/input.txt').read().strip())\n"
                 "open('out.txt', 'w').write('done')")
  assert (r.exit_code, r.timed_out, r.limit_hit) == (0, False, None)
  assert r.stdout.split() == ["/workspace", "/usr/bin/python3", "42"]
  assert (sb.workspace / "out.txt").read_text() == "done"
  r = sb.execute("bash", "python -c 'print(6*7)'; echo oops >&2; exit 3")
  assert (r.exit_code, r.stdout, r.stderr) == (3, "42\n", "oops\n")
  assert r.observation == workflow.format_observation(3, "42\n", "oops\n")
  assert r.observation.startswith("exit_code=3\nstdout:42\n")


def test_environment_is_cleared(make_sandbox, monkeypatch):
  monkeypatch.setenv("BAT_HOST_SECRET", "s3cr3t")
  r = make_sandbox().execute("bash", "env; hostname")
  assert r.exit_code == 0
  assert "s3cr3t" not in r.stdout
  assert "HOME=/tmp" in r.stdout.splitlines()
  assert r.stdout.splitlines()[-1] == "sandbox"
  r = make_sandbox().execute("python", "import numpy")  # the system python: stdlib only
  assert r.exit_code == 1 and "ModuleNotFoundError" in r.stderr


def test_evidence_records_every_call(make_sandbox, tmp_path):
  sb = make_sandbox(files={"keep.txt": "k", "drop.txt": "d"})
  code = "open('new.txt','w').write('n'); import os; os.remove('drop.txt')"
  sb.execute("python", code)
  sb.execute("bash", "exit 7")
  recs = sb.evidence
  assert [r.call_index for r in recs] == [0, 1]
  assert recs[0].code_sha256 == hashlib.sha256(code.encode()).hexdigest()
  assert recs[0].changed == {"drop.txt": None, "new.txt": hashlib.sha256(b"n").hexdigest()}
  assert recs[0].fingerprint_before != recs[0].fingerprint_after
  assert (recs[1].language, recs[1].exit_code, recs[1].changed) == ("bash", 7, {})
  assert recs[1].fingerprint_before == recs[1].fingerprint_after == recs[0].fingerprint_after
  assert load_evidence(tmp_path / "evidence.jsonl") == recs
  # A new Sandbox on the same log continues it.
  sb2 = Sandbox(sb.workspace, FAST, evidence_path=tmp_path / "evidence.jsonl")
  sb2.execute("bash", "true")
  assert [r.call_index for r in sb2.evidence] == [0, 1, 2]


def test_evidence_log_inside_workspace_is_refused(make_sandbox, tmp_path):
  sb = make_sandbox()
  with pytest.raises(ValueError, match="inside the workspace"):
    Sandbox(sb.workspace, FAST, evidence_path=sb.workspace / "ev.jsonl")


def test_agent_cannot_see_or_forge_evidence_log(make_sandbox, tmp_path):
  sb = make_sandbox()
  sb.execute("bash", "true")
  before = (tmp_path / "evidence.jsonl").read_bytes()
  r = sb.execute("bash", f"cat {tmp_path}/evidence.jsonl; echo forged >> {tmp_path}/evidence.jsonl")
  assert r.exit_code != 0 and "No such file or directory" in r.stderr
  assert (tmp_path / "evidence.jsonl").read_bytes().startswith(before)
  assert len(load_evidence(tmp_path / "evidence.jsonl")) == 2


def test_unknown_language_is_refused_naming_it(make_sandbox):
  sb = make_sandbox()
  with pytest.raises(ValueError, match="'ruby'"):
    sb.execute("ruby", "puts 1")
  assert sb.evidence == []


def test_oversized_code_is_not_run_but_recorded(make_sandbox):
  sb = make_sandbox()
  r = sb.execute("python", "x = 1\n" * 30_000)
  assert (r.exit_code, r.limit_hit) == (2, "code_size")
  assert "not run" in r.observation
  assert sb.evidence[-1].limit_hit == "code_size"


def test_observation_is_cut_with_marker(make_sandbox):
  r = make_sandbox().execute("python", "print('y' * 5000)")
  assert r.exit_code == 0 and len(r.stdout) == 5001
  assert len(r.observation) == workflow.MAX_OBSERVATION_CHARS
  assert "...[truncated" in r.observation


def test_format_observation_counts_removed_chars():
  for n in (2040, 2100, 9000, 150_000):
    text_len = len(workflow.format_observation(0, "x" * n, "", max_chars=10**9))
    obs = workflow.format_observation(0, "x" * n, "")
    assert len(obs) == workflow.MAX_OBSERVATION_CHARS
    kept, marker = obs.split("\n...[truncated ")
    assert int(marker.split()[0]) == text_len - len(kept)


def test_missing_bwrap_fails_clearly(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH
  bwrap_lib.host_tools.cache_clear()
  bwrap_lib.check_available.cache_clear()
  try:
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
      Sandbox(tmp_path, FAST)
  finally:
    bwrap_lib.host_tools.cache_clear()
    bwrap_lib.check_available.cache_clear()


def test_limits_are_validated():
  with pytest.raises(ValueError, match="SandboxLimits.memory_mb"):
    bwrap_lib.SandboxLimits(memory_mb=0)


def test_concurrent_sandboxes_stay_separate(tmp_path, require_bwrap):
  boxes = []
  for i in range(4):
    materialize({"id.txt": str(i)}, tmp_path / f"ws{i}")
    boxes.append(Sandbox(tmp_path / f"ws{i}", FAST, evidence_path=tmp_path / f"ev{i}.jsonl"))
  code = "import time; time.sleep(0.2); v = open('id.txt').read(); open('seen.txt','w').write(v)"
  with ThreadPoolExecutor(4) as pool:
    results = list(pool.map(lambda sb: sb.execute("python", code), boxes))
  assert [r.exit_code for r in results] == [0] * 4
  for i, sb in enumerate(boxes):
    assert (sb.workspace / "seen.txt").read_text() == str(i)
    assert list(load_evidence(tmp_path / f"ev{i}.jsonl")[0].changed) == ["seen.txt"]
