"""Per-call overhead of the bubblewrap sandbox vs a plain, unsandboxed subprocess (same run).

Each sandboxed call includes everything `Sandbox.execute` does: workspace fingerprint before
and after, a fresh bwrap sandbox (forked by the Sandbox's launcher inside its memory cgroup)
with its limits, bounded output capture, the in-call disk watch and the evidence-log append.
The reference runs the same trivial code with `subprocess.run`, no isolation. Sandboxed and
plain calls alternate, so load on the host hits both alike; medians per call are compared.
A per-phase breakdown of the sandboxed call follows. The last line is the difference
(sandboxed - plain, ms per call, both languages).

  PYTHONPATH=. python experiments/perf/sandbox_overhead.py --calls 40
"""

from __future__ import annotations

import argparse
import os
import collections
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bat_jax.sandbox import Sandbox, SandboxLimits, bwrap, launcher, materialize, process
from bat_jax.sandbox import cgroup

TRIVIAL = {"python": "print(6 * 7)", "bash": "echo 42"}
_PLAIN_ARGV = {"python": ["/usr/bin/python3", "-c"], "bash": ["/bin/bash", "-c"]}
# A small but realistic task workspace, so fingerprinting costs what it costs in rollouts.
_WORKSPACE = {f"data/case_{i:03d}.pgm": bytes(range(256)) * 16 for i in range(40)}
_WORKSPACE |= {"task/spec.json": '{"track": "classification"}', "data/index.csv": "id\n" * 40}
# The phases of one call, timed by wrapping these functions (module, name, label).
_PHASES = [(bwrap.workspace_lib, "claim", "chown walk"),
           (bwrap.Sandbox, "_scan", "fingerprints (before + after)"),
           (launcher.Launcher, "start", "launcher: request -> bwrap forked"),
           (process, "_pump", "bwrap runs (setup, code, output)"),
           (process, "_reap", "exit status + PID 1 gone"),
           (bwrap.evidence_lib, "append_record", "evidence append")]


def _timed(fn, totals: dict, label: str):
  def wrapper(*a, **k):
    t0 = time.perf_counter()
    try:
      return fn(*a, **k)
    finally:
      totals[label] += time.perf_counter() - t0
  return wrapper


def measure_overhead(n: int = 20, limits: SandboxLimits = SandboxLimits()) -> dict[str, float]:
  """Median ms per trivial call, sandboxed and plain (alternating), for python and bash.

  Returns:
    {"sandbox_python_ms", "plain_python_ms", "sandbox_bash_ms", "plain_bash_ms",
     "overhead_ms" (mean over languages of sandboxed - plain), "ratio" (sandboxed / plain,
     both languages), "fastest_overhead_ms" (the same from each side's fastest call: what
     host load adds least to), "phase:<label>" (mean ms per sandboxed call in that phase)}.
  """
  out: dict[str, float] = {}
  totals: dict[str, float] = collections.defaultdict(float)
  saved = [(mod, name, getattr(mod, name)) for mod, name, _ in _PHASES]
  with tempfile.TemporaryDirectory(prefix="bat-sandbox-perf-") as tmp:
    materialize(_WORKSPACE, Path(tmp) / "ws")
    sandbox = Sandbox(Path(tmp) / "ws", limits, evidence_path=Path(tmp) / "evidence.jsonl")
    for language, code in TRIVIAL.items():
      for _ in range(2):  # warm-up: the launcher starts, page cache, interpreter startup
        sandbox.execute(language, code)
        subprocess.run(_PLAIN_ARGV[language] + [code], capture_output=True, cwd=tmp)
    try:
      for mod, name, label in _PHASES:
        setattr(mod, name, _timed(getattr(mod, name), totals, label))
      for language, code in TRIVIAL.items():
        boxed, plain = [], []
        for _ in range(n):
          t0 = time.perf_counter()
          r = sandbox.execute(language, code)
          boxed.append(time.perf_counter() - t0)
          assert r.exit_code == 0 and r.stdout == "42\n", r.observation
          t0 = time.perf_counter()
          p = subprocess.run(_PLAIN_ARGV[language] + [code], capture_output=True, cwd=tmp)
          plain.append(time.perf_counter() - t0)
          assert p.stdout == b"42\n"
        out[f"sandbox_{language}_ms"] = statistics.median(boxed) * 1e3
        out[f"plain_{language}_ms"] = statistics.median(plain) * 1e3
        out[f"fastest_diff_{language}_ms"] = (min(boxed) - min(plain)) * 1e3
    finally:
      for mod, name, fn in saved:
        setattr(mod, name, fn)
  for label, total in totals.items():
    out[f"phase:{label}"] = total / (n * len(TRIVIAL)) * 1e3
  sandboxed_total = out["sandbox_python_ms"] + out["sandbox_bash_ms"]
  plain_total = out["plain_python_ms"] + out["plain_bash_ms"]
  out["overhead_ms"] = (sandboxed_total - plain_total) / 2
  out["fastest_overhead_ms"] = sum(out[f"fastest_diff_{lang}_ms"] for lang in TRIVIAL) / 2
  out["ratio"] = sandboxed_total / plain_total
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=20, help="timed calls per language and mode")
  args = parser.parse_args()
  mode = bwrap.check_available(os.geteuid() == 0)
  print(f"sandbox mode {mode}, memory cgroup: {'yes' if cgroup.available() else 'no'}")
  r = measure_overhead(args.calls)
  print("sandboxed call, mean ms per phase:")
  for key, value in r.items():
    if key.startswith("phase:"):
      print(f"  {key[6:]:38s} {value:6.2f}")
  for language in TRIVIAL:
    print(f"{language:6s}: sandbox {r[f'sandbox_{language}_ms']:7.2f} ms/call   "
          f"plain subprocess {r[f'plain_{language}_ms']:7.2f} ms/call (medians)")
  print(f"ratio sandbox/plain (time per call, lower is better): {r['ratio']:.2f}x")
  print(f"fastest sandboxed - fastest plain call (least load-bound), ms: "
        f"{r['fastest_overhead_ms']:.2f}")
  print(f"sandbox overhead (sandboxed - plain, ms/call): {r['overhead_ms']:.2f}")


if __name__ == "__main__":
  main()
