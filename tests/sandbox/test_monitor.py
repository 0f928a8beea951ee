"""The polled memory count's scratch term, read while bwrap builds and runs a sandbox.

A non-root harness has no cgroup, so `monitor.call_memory_bytes` is what caps a call's memory.
Its scratch term reads the sandbox's own /tmp and /dev/shm through /proc/<pid1>/root; polled
while bwrap pivots its root, it once read the host's disk (36.7 GB "used" on a 256 MB cap) and
killed an `echo` as a memory-limit hit (about 1 call in 600 at a 0.1 s poll).
"""

import json
import os
import subprocess

from bat_jax.sandbox import monitor

_MB = 1 << 20
_SCRATCH_MB = 16


def _bwrap(info_w: int, script: str) -> list[str]:
  size = str(_SCRATCH_MB * _MB)
  return ["bwrap", "--unshare-all", "--die-with-parent", "--info-fd", str(info_w),
          "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib",
          "/lib", "--symlink", "usr/lib64", "/lib64", "--dev", "/dev", "--size", size,
          "--tmpfs", "/dev/shm", "--proc", "/proc", "--size", size, "--tmpfs", "/tmp",
          "sh", "-c", script]


def _spin(script: str) -> int:
  """Starts one sandbox and polls its scratch count as fast as possible until it exits (the
  setup's mount changes are then hit far more often than at the harness's poll period)."""
  info_r, info_w = os.pipe()
  proc = subprocess.Popen(_bwrap(info_w, script), pass_fds=(info_w,))
  os.close(info_w)
  with os.fdopen(info_r, "rb") as info:
    buf = b""
    while b"}" not in buf:
      chunk = info.read1(4096)
      assert chunk, f"bwrap exited before naming its child (exit {proc.wait()})"
      buf += chunk
  pid1 = json.loads(buf)["child-pid"]
  seen = 0
  while proc.poll() is None:
    seen = max(seen, monitor._scratch_bytes(pid1))  # pylint: disable=protected-access
  assert proc.returncode == 0, f"bwrap exited {proc.returncode}"
  return seen


def test_scratch_count_never_reads_the_host_disk_during_setup(require_bwrap):
  # Before the fix 8% of these calls read the host's disk (15 of 200 on a 2-core box).
  seen = [_spin("true") for _ in range(150)]
  over = [s for s in seen if s > _SCRATCH_MB * _MB]
  assert not over, f"{len(over)} of {len(seen)} calls read {max(over)} B (cap {_SCRATCH_MB} MB)"


def test_scratch_count_sees_what_the_sandbox_writes_to_tmp_and_dev_shm(require_bwrap):
  seen = _spin("head -c 5M /dev/zero > /tmp/a; head -c 3M /dev/zero > /dev/shm/b; sleep 0.5")
  assert 8 * _MB <= seen <= 9 * _MB, seen
