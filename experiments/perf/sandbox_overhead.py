"""Per-call overhead of the bubblewrap sandbox vs a plain, unsandboxed subprocess (same run).

Each sandboxed call includes everything `Sandbox.execute` does: workspace fingerprint before
and after, a fresh bwrap sandbox with its limits, bounded output capture and the fsync'ed
evidence-log append. The reference runs the same trivial code with `subprocess.run`, no
isolation. The hardening parts of a call (per-call memory cgroup, the rename that hides the
workspace's host path, the bounded disk walk the in-call watch runs) are also timed on their
own. The last line is the sandboxed / plain ratio (both languages together).

  PYTHONPATH=. python experiments/perf/sandbox_overhead.py --calls 50
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from bat_jax.sandbox import Sandbox, SandboxLimits, bwrap, cgroup, materialize
from bat_jax.sandbox import workspace as workspace_lib

TRIVIAL = {"python": "print(6 * 7)", "bash": "echo 42"}
_PLAIN_ARGV = {"python": ["/usr/bin/python3", "-c"], "bash": ["/bin/bash", "-c"]}
# A small but realistic task workspace, so fingerprinting costs what it costs in rollouts.
_WORKSPACE = {f"data/case_{i:03d}.pgm": bytes(range(256)) * 16 for i in range(40)}
_WORKSPACE |= {"task/spec.json": '{"track": "classification"}', "data/index.csv": "id\n" * 40}


def _ms_per_call(fn, n: int) -> float:
  fn()  # warm-up: page cache, interpreter startup
  t0 = time.perf_counter()
  for _ in range(n):
    fn()
  return (time.perf_counter() - t0) / n * 1e3


def measure_overhead(n: int = 20, limits: SandboxLimits = SandboxLimits()) -> dict[str, float]:
  """ms per trivial call, sandboxed and plain, for python and bash.

  Returns:
    {"sandbox_python_ms", "plain_python_ms", "sandbox_bash_ms", "plain_bash_ms",
     "overhead_ms" (mean sandboxed - plain per call), "ratio" (sandboxed / plain, both
     languages)}.
  """
  out: dict[str, float] = {}
  with tempfile.TemporaryDirectory(prefix="bat-sandbox-perf-") as tmp:
    materialize(_WORKSPACE, Path(tmp) / "ws")
    sandbox = Sandbox(Path(tmp) / "ws", limits, evidence_path=Path(tmp) / "evidence.jsonl")
    for language, code in TRIVIAL.items():

      def sandboxed(language=language, code=code):
        r = sandbox.execute(language, code)
        assert r.exit_code == 0 and r.stdout == "42\n", r.observation

      def plain(language=language, code=code):
        r = subprocess.run(_PLAIN_ARGV[language] + [code], capture_output=True, cwd=tmp,
                           check=True)
        assert r.stdout == b"42\n"

      out[f"sandbox_{language}_ms"] = _ms_per_call(sandboxed, n)
      out[f"plain_{language}_ms"] = _ms_per_call(plain, n)
  sandboxed_total = out["sandbox_python_ms"] + out["sandbox_bash_ms"]
  plain_total = out["plain_python_ms"] + out["plain_bash_ms"]
  out["overhead_ms"] = (sandboxed_total - plain_total) / 2
  out["ratio"] = sandboxed_total / plain_total
  return out


def measure_hardening(n: int = 50, limits: SandboxLimits = SandboxLimits()) -> dict[str, float]:
  """ms per call of each hardening step, on the same workspace as `measure_overhead`."""
  out: dict[str, float] = {}
  with tempfile.TemporaryDirectory(prefix="bat-sandbox-perf-") as tmp:
    ws = Path(tmp) / "ws"
    materialize(_WORKSPACE, ws)
    stage = workspace_lib.neutral_stage(ws)

    def group():
      with bwrap._memory_cgroup(limits):  # pylint: disable=protected-access
        pass

    def staged():
      with workspace_lib.staged(ws, stage):
        pass
    out["cgroup_ms"] = _ms_per_call(group, n) if cgroup.available() else 0.0
    out["staging_ms"] = _ms_per_call(staged, n)
    out["disk_walk_ms"] = _ms_per_call(lambda: workspace_lib.scan(ws, hash_files=False), n)
    if stage is not None:
      stage.rmdir()
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=20, help="timed calls per language and mode")
  args = parser.parse_args()
  h = measure_hardening(max(args.calls, 20))
  print(f"hardening, ms/call: memory cgroup {h['cgroup_ms']:.2f} (0: none here), "
        f"path-hiding rename {h['staging_ms']:.2f}, "
        f"disk walk {h['disk_walk_ms']:.2f} (per watch poll; none in calls under 0.2 s)")
  r = measure_overhead(args.calls)
  for language in TRIVIAL:
    print(f"{language:6s}: sandbox {r[f'sandbox_{language}_ms']:7.2f} ms/call   "
          f"plain subprocess {r[f'plain_{language}_ms']:7.2f} ms/call")
  print(f"sandbox overhead: {r['overhead_ms']:.2f} ms/call")
  print(f"ratio sandbox/plain (time per call, lower is better): {r['ratio']:.2f}x")


if __name__ == "__main__":
  main()
