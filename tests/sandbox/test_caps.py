"""Adversarial: resource caps hold DURING the call, however the memory or disk is held.

Class "resource caps". Memory attacks run twice: with the per-call memory cgroup (when this
host allows one) and with the polling fallback (cgroup disabled), so both paths are checked.
Each attack is bounded: small caps, a wall limit, and a time assertion.
"""

import dataclasses
import math
import time

import pytest
from sandbox_helpers import FAST, processes_of, processes_running

from bat_jax.sandbox import SandboxLimits, cgroup, load_evidence, process

# Memory cap 256 MB; scratch tmpfs sized at 512 MB so only the memory cap can stop them.
MEM = dataclasses.replace(FAST, wall_s=20.0, cpu_s=15, memory_mb=256, max_workspace_mb=512)

MEMORY_ATTACKS = {
    # 450 MB, as the others: 600 MB crossed RLIMIT_FSIZE (max_workspace_mb, 512) first when a
    # loaded box slowed the polling fallback, and the write failed with EFBIG instead.
    "memfd": "import os\nfd = os.memfd_create('x')\n"
             "for _ in range(45): os.write(fd, b'x' * (10 << 20))\nimport time; time.sleep(30)",
    "shared_mmap_8_procs": "import mmap, os, time\n"
                           "for _ in range(8):\n"
                           "  if os.fork() == 0:\n"
                           "    m = mmap.mmap(-1, 100 << 20, mmap.MAP_SHARED)\n"
                           "    for i in range(0, 100 << 20, 4096): m[i] = 1\n"
                           "    time.sleep(30)\n"
                           "time.sleep(30)",
    "dev_shm": "import time\nf = open('/dev/shm/x', 'wb')\n"
               "for _ in range(45): f.write(b'x' * (10 << 20)); f.flush()\ntime.sleep(30)",
    "tmp_tmpfs": "import time\nf = open('/tmp/x', 'wb')\n"
                 "for _ in range(45): f.write(b'x' * (10 << 20)); f.flush()\ntime.sleep(30)",
    "posix_shm_across_procs": "import os, time\nfrom multiprocessing import shared_memory\n"
                              "blocks = [shared_memory.SharedMemory(create=True, size=80 << 20)"
                              " for _ in range(5)]\n"
                              "for b in blocks: b.buf[::4096] = bytes(len(b.buf[::4096]))\n"
                              "time.sleep(30)",
}


@pytest.fixture(params=["cgroup", "polling"])
def memory_mode(request, monkeypatch):
  if request.param == "cgroup":
    if not cgroup.available():
      pytest.skip("no writable memory cgroup here (the polling fallback is tested)")
  else:
    monkeypatch.setattr(cgroup, "available", lambda: False)
  return request.param


@pytest.mark.parametrize("attack", sorted(MEMORY_ATTACKS))
def test_memory_cap_holds_however_memory_is_held(make_sandbox, memory_mode, attack):
  sb = make_sandbox(MEM)
  t0 = time.monotonic()
  r = sb.execute("python", MEMORY_ATTACKS[attack])
  assert r.limit_hit == "memory", (r.limit_hit, r.exit_code, r.stderr[-500:])
  assert time.monotonic() - t0 < 15.0 and not r.timed_out
  assert f"memory limit of {MEM.memory_mb} MB hit" in r.observation
  if sb.host_uid is not None:
    assert processes_of(sb.host_uid) == []


def test_sysv_shared_memory_is_charged_or_refused(make_sandbox, memory_mode):
  """Segments detached after filling outlive every mapping: charged by the cgroup, and refused
  (shmget EPERM) where only polling could count memory."""
  sb = make_sandbox(MEM)
  code = ("import ctypes, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "libc.shmat.restype = ctypes.c_void_p\n"
          "for _ in range(6):\n  i = libc.shmget(0, ctypes.c_size_t(100 << 20), 0o1600)\n"
          "  if i < 0: raise SystemExit(f'shmget errno {ctypes.get_errno()}')\n"
          "  p = libc.shmat(i, None, 0)\n  ctypes.memset(p, 1, 100 << 20)\n"
          "  libc.shmdt(ctypes.c_void_p(p))\ntime.sleep(30)")
  r = sb.execute("python", code)
  if memory_mode == "cgroup":
    assert r.limit_hit == "memory" and not r.timed_out, (r.limit_hit, r.stderr[-300:])
  else:
    assert r.exit_code == 1 and "shmget errno 1" in r.stderr and not r.timed_out


def test_disk_cap_holds_during_the_call_and_nothing_stays(make_sandbox):
  sb = make_sandbox(dataclasses.replace(FAST, wall_s=20.0, cpu_s=15))
  t0 = time.monotonic()
  # Files each under the 8 MB per-file cap, 70 MB in all, then a long sleep: the in-call watch
  # must stop it (the sleep would otherwise run into the wall limit).
  r = sb.execute("bash", "for i in $(seq 14); do head -c 5M /dev/zero > part$i.bin; done; "
                         "sleep 30")
  assert r.limit_hit == "workspace" and not r.timed_out and r.exit_code == 137
  assert time.monotonic() - t0 < 10.0
  assert not list(sb.workspace.glob("part*"))
  rec = load_evidence(sb.evidence_path)[-1]
  assert rec.limit_hit == "workspace" and not any(k.startswith("part") for k in rec.changed)
  # Exiting 0 before the watch looks does not help: the post-call check removes it all.
  r = sb.execute("bash", "for i in 1 2; do head -c 6M /dev/zero > q$i.bin; done")
  assert r.limit_hit == "workspace" and not list(sb.workspace.glob("q*"))
  assert (sb.workspace / "data" / "input.txt").read_text() == "42\n"  # what was there stays


def test_sparse_files_count_at_their_size(make_sandbox):
  sb = make_sandbox()
  r = sb.execute("bash", "for i in 1 2 3; do truncate -s 7M s$i; done")
  assert r.limit_hit == "workspace" and not list(sb.workspace.glob("s*"))


@pytest.mark.parametrize("field", ["wall_s", "memory_mb", "max_workspace_mb", "cpu_s"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, -1])
def test_non_finite_or_non_positive_limits_are_refused(field, value):
  with pytest.raises(ValueError, match=f"SandboxLimits.{field} must be a finite positive"):
    SandboxLimits(**{field: value})


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0])
def test_config_validation_names_the_sandbox_field(value):
  from bat_jax import config_validation
  from configs import base
  cfg = base.get_config()
  with cfg.unlocked():
    cfg.sandbox.wall_s = value
  with pytest.raises(config_validation.ConfigError, match=r"config\.sandbox\.wall_s: must be a "
                                                          r"finite number > 0"):
    config_validation.validate_config(cfg)


def test_run_bwrap_refuses_nan_wall_before_starting_anything(make_sandbox, tmp_path):
  with process.call_fds(tmp_path) as fds:
    with pytest.raises(ValueError, match="wall_s must be a finite positive"):
      process.run_bwrap(["/bin/true"], fds, wall_s=math.nan, max_output_bytes=1,
                      max_memory_bytes=1)


@pytest.mark.parametrize("where", ["watch", "memory_poll"])
def test_an_exception_in_run_bwrap_kills_the_sandbox(make_sandbox, monkeypatch, where):
  sb = make_sandbox(dataclasses.replace(FAST, wall_s=20.0))
  marker = f"bat-harden-{where}-7d1e"
  calls = []

  def boom(*a, **k):
    calls.append(1)
    if len(calls) > 2:  # let the sandbox start its background processes first
      raise RuntimeError("monitor failed")
    return None if where == "watch" else 0
  if where == "watch":
    monkeypatch.setattr(sb, "_watch", lambda staged: boom)
  else:
    monkeypatch.setattr(cgroup, "available", lambda: False)
    monkeypatch.setattr(process.monitor, "call_memory_bytes", boom)
  code = (f"( trap '' TERM; exec -a {marker} sleep 60 ) & "
          f"( trap '' TERM; exec -a {marker} sleep 60 ) & sleep 60")
  with pytest.raises(RuntimeError, match="monitor failed"):
    sb.execute("bash", code)
  time.sleep(0.3)
  assert processes_running(marker) == []
  if sb.host_uid is not None:
    assert processes_of(sb.host_uid) == []
  assert load_evidence(sb.evidence_path)[-1].limit_hit == "harness_error"
