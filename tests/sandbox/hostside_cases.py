"""Agent moves against the host side, run by tests as root and as an unprivileged harness.

Each function builds its own Sandbox under `base`, plays the moves, and returns plain data (JSON)
for the test to assert on, so the same code runs in-process (root harness) and in a subprocess
dropped to an unprivileged uid (`sandbox_helpers.run_unprivileged`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from sandbox_helpers import FAST

from bat_jax.sandbox import Sandbox, SandboxLimits, load_evidence, materialize, safe_fs

# Three 3 MB files (each under the 8 MB per-file cap, 9 MB in all) hidden from the size count.
_FILL = "mkdir -p h/i; for n in 1 2 3; do head -c 3M /dev/zero > h/i/f$n; done; "
HIDE = {
    "dir_000": _FILL + "chmod 000 h/i h",
    "dir_without_x": _FILL + "chmod 600 h/i h",
    "dir_without_r": _FILL + "chmod 300 h/i h",
    "dir_000_during_the_call": _FILL + "chmod 000 h/i h; sleep 30",
}
STRIP = {
    "chmod_R_000": "mkdir -p a/b; echo x > a/b/c; chmod -R 000 a; chmod 000 /workspace",
    "workspace_555": "mkdir -p a/b; echo x > a/b/c; chmod 555 a/b a /workspace",
    "workspace_000_during_the_call": "echo x > f; chmod 000 f /workspace; sleep 1",
    "write_only_dirs": "mkdir -p d/e; touch d/e/f; chmod 200 d/e d",
    "read_only_tree": "mkdir -p t/u; touch t/u/v; chmod 500 t/u t; chmod 400 t/u/v",
}
# 450 MB each, over the 256 MB cap and under RLIMIT_FSIZE (max_workspace_mb, 512): at 600 MB a
# loaded box slowed the polling fallback and the write failed with EFBIG before the cap was seen.
MEMORY = {
    "memfd_write": "import os, time\nfd = os.memfd_create('x')\n"
                   "for _ in range(45): os.write(fd, b'x' * (10 << 20))\ntime.sleep(30)",
    "memfd_ftruncate_mmap": "import mmap, os, time\nheld = []\nfor _ in range(6):\n"
                            "  fd = os.memfd_create('x'); os.ftruncate(fd, 100 << 20)\n"
                            "  m = mmap.mmap(fd, 100 << 20); os.close(fd); held.append(m)\n"
                            "  m.write(b'x' * (100 << 20))\ntime.sleep(30)",
    "memfd_then_exec_sleep": "import os\nfd = os.memfd_create('x', 0)\n"
                             "for _ in range(45): os.write(fd, b'x' * (10 << 20))\n"
                             "os.execv('/bin/sleep', ['sleep', '30'])",
    "dev_shm": "import time\nf = open('/dev/shm/x', 'wb')\n"
               "for _ in range(45): f.write(b'x' * (10 << 20)); f.flush()\ntime.sleep(30)",
}
MEM = dataclasses.replace(FAST, wall_s=20.0, cpu_s=15, memory_mb=256, max_workspace_mb=512)


def _sandbox(base: Path, name: str, limits: SandboxLimits) -> Sandbox:
  ws = base / name / "ws"
  materialize({"data/input.txt": "42\n"}, ws)
  return Sandbox(ws, limits, evidence_path=base / name / "evidence.jsonl")


def _after(sb: Sandbox) -> dict:
  """What the harness finds once the moves are done: the workspace in place, a next call that
  works, an empty stage, and a teardown that removes everything."""
  nxt = sb.execute("bash", "cat data/input.txt")
  stage = sb._stage  # pylint: disable=protected-access
  out = {"in_place": sb.workspace.is_dir(), "next_exit": nxt.exit_code, "next_out": nxt.stdout,
         # which limit stopped a next call that failed (a failure's message names it)
         "next_limit": nxt.limit_hit, "next_observation": nxt.observation[-300:],
         "stage_empty": stage is None or not os.listdir(stage)}
  sb.close()
  folder = sb.workspace.parent
  safe_fs.remove_tree(folder)
  out["removed"] = not os.path.lexists(folder)
  return out


def hide_from_disk_cap(base: str) -> dict:
  results = {}
  for name, code in HIDE.items():
    sb = _sandbox(Path(base), name, dataclasses.replace(FAST, wall_s=20.0, cpu_s=15))
    r = sb.execute("bash", code)
    results[name] = {"limit": r.limit_hit, "timed_out": r.timed_out,
                     "recorded": load_evidence(sb.evidence_path)[-1].limit_hit,
                     "hidden_left": os.path.lexists(sb.workspace / "h"), **_after(sb)}
  return results


def strip_permissions(base: str) -> dict:
  results = {}
  for name, code in STRIP.items():
    sb = _sandbox(Path(base), name, FAST)
    r = sb.execute("bash", code)
    results[name] = {"exit": r.exit_code, "limit": r.limit_hit, **_after(sb)}
  return results


def memory_via_shared_memory(base: str) -> dict:
  results = {}
  sb = _sandbox(Path(base), "memory", MEM)
  for name, code in MEMORY.items():
    r = sb.execute("python", code)
    results[name] = {"limit": r.limit_hit, "timed_out": r.timed_out,
                     "recorded": load_evidence(sb.evidence_path)[-1].limit_hit}
  results["after"] = _after(sb)
  return results
