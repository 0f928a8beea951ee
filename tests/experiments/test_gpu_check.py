"""experiments/gpu/check.sh on a box that has only jax, torch and transformers (the lent GPU
box): the check installs the rest offline from tools/gpu_wheelhouse.sh's wheelhouse, and every
step runs to its own result; without the wheelhouse each step says which module is missing.

The bare box is simulated with a `sitecustomize` import blocker: the check's extra modules
(flax, optax, absl, pytest, ...) import only from the folder check.sh installs the wheels into.
On this CPU box the check runs its reduced-shape CPU mode.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / ".whl" / "gpu"
# Everything the check needs beyond jax / torch / transformers (and their dependencies), plus
# packages of the full environment the check must not need.
BLOCKED = ("flax", "optax", "absl", "ml_collections", "treescope", "rich", "markdown_it",
           "mdurl", "pygments", "etils", "cloudpickle", "msgpack", "pytest", "iniconfig",
           "pluggy", "_pytest", "orbax", "tensorstore", "grain", "array_record", "chex",
           "matplotlib", "tensorboardX", "hypothesis", "openai")
BLOCKER = '''
import importlib.machinery, os, sys
BLOCKED = set(os.environ["GPU_CHECK_BLOCKED"].split(","))
ALLOWED = os.environ["GPU_CHECK_ALLOWED"]
class _BareBox(importlib.machinery.PathFinder):
  """The path finder, except that BLOCKED top-level modules are looked up only under ALLOWED
  (the check's offline install): anywhere else they are not installed."""
  @classmethod
  def find_spec(cls, name, path=None, target=None):
    if path is None and name in BLOCKED:
      path = [p for p in sys.path if os.path.abspath(p or ".").startswith(ALLOWED)]
    return super().find_spec(name, path, target)
sys.meta_path[:] = [_BareBox if f is importlib.machinery.PathFinder else f
                    for f in sys.meta_path]
'''


# This shared 2-core box runs the steps several times slower than their GPU-box limits allow.
TIME_SCALE = int(os.environ.get("GPU_CHECK_TIME_SCALE", "3"))


def _run_check(tmp_path: Path, wheelhouse: Path, timeout: int) -> tuple[str, list[str]]:
  blocker = tmp_path / "blocker"
  blocker.mkdir()
  (blocker / "sitecustomize.py").write_text(BLOCKER)
  out = tmp_path / "out"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  env.update(PYTHON=sys.executable, OUT=str(out), WHEELHOUSE=str(wheelhouse),
             PYTHONPATH=str(blocker), GPU_CHECK_BLOCKED=",".join(BLOCKED),
             GPU_CHECK_ALLOWED=str(out / "gpu_check" / "site"), JAX_PLATFORMS="cpu",
             TIME_SCALE=str(TIME_SCALE))
  # The blocker works: a blocked module is missing outside the check's install folder.
  probe = subprocess.run([sys.executable, "-c", "import flax"], env=env, capture_output=True,
                         text=True)
  assert "No module named 'flax'" in probe.stderr, probe.stderr[-500:]
  proc = subprocess.run(["bash", str(ROOT / "experiments/gpu/check.sh")], env=env,
                        capture_output=True, text=True, timeout=timeout)
  summary = (out / "gpu_check_summary.txt").read_text()
  rows = {line.split()[0]: line for line in summary.splitlines()[2:]
          if line.split() and line.split()[0] in ("setup", "versions", "parity", "deltanet",
                                                   "plan", "grpo_9b")}
  assert list(rows) == ["setup", "versions", "parity", "deltanet", "plan", "grpo_9b"], (
      summary + proc.stdout[-3000:])
  return summary, list(rows.values())


@pytest.mark.slow
def test_without_the_wheelhouse_each_step_names_the_missing_module(tmp_path):
  summary, rows = _run_check(tmp_path, tmp_path / "no_wheelhouse", timeout=600 * TIME_SCALE)
  assert "missing module: flax" in rows[0], summary          # setup: nothing to install from
  for row in rows[1:]:
    assert "missing module:" in row, summary                # never a misleading message
  assert "memory_plan is missing" not in summary


@pytest.mark.slow
@pytest.mark.skipif(not WHEELHOUSE.is_dir(), reason="no wheelhouse: bash tools/gpu_wheelhouse.sh")
def test_with_the_wheelhouse_every_step_runs_to_its_own_result(tmp_path):
  summary, rows = _run_check(tmp_path, WHEELHOUSE, timeout=600 * TIME_SCALE)
  for row in rows:
    assert row.split()[1] == "ok" and "missing module" not in row, summary
  assert "measured peak per device: n/a (this backend reports no memory_stats)" in summary
  assert "plan peak per device:" in summary and "n/a (no plan)" not in summary
  total = int(summary.rsplit("total ", 1)[1].split("s;")[0])
  assert total <= 480 * TIME_SCALE, summary   # the 8-minute budget, stretched as the limits
