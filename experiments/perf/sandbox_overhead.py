"""Per-call overhead of the bubblewrap sandbox vs a plain, unsandboxed subprocess (same run).

Each sandboxed call includes everything `Sandbox.execute` does: workspace fingerprint before
and after, a fresh bwrap sandbox with its limits, bounded output capture and the fsync'ed
evidence-log append. The reference runs the same trivial code with `subprocess.run`, no
isolation. The last line is the sandboxed / plain ratio (both languages together).

  PYTHONPATH=. python experiments/perf/sandbox_overhead.py --calls 50
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from bat_jax.sandbox import Sandbox, SandboxLimits, materialize

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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=20, help="timed calls per language and mode")
  args = parser.parse_args()
  r = measure_overhead(args.calls)
  for language in TRIVIAL:
    print(f"{language:6s}: sandbox {r[f'sandbox_{language}_ms']:7.2f} ms/call   "
          f"plain subprocess {r[f'plain_{language}_ms']:7.2f} ms/call")
  print(f"sandbox overhead: {r['overhead_ms']:.2f} ms/call")
  print(f"ratio sandbox/plain (time per call, lower is better): {r['ratio']:.2f}x")


if __name__ == "__main__":
  main()
