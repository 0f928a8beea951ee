"""House rules CI enforces: the pinned linter runs before the tests and finds nothing; no binary
files sit at the repository root."""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_pinned_linter_before_the_tests():
  lines = (ROOT / ".ci/run").read_text().splitlines()
  commands = [line.strip() for line in lines if not line.lstrip().startswith("#")]
  lint = commands.index("python -m ruff check .")
  tests = next(i for i, c in enumerate(commands) if c.startswith("python -m pytest"))
  assert lint < tests
  pins = re.findall(r"^ruff==(\d+\.\d+\.\d+)$", (ROOT / "requirements-dev.txt").read_text(),
                    re.M)
  assert len(pins) == 1
  assert re.search(r'select = \[[^]]*"F"', (ROOT / "pyproject.toml").read_text())


def test_the_tree_is_lint_clean():
  try:
    import ruff  # noqa: F401 (only to know it is installed)
  except ImportError:
    if shutil.which("ruff") is None:
      pytest.skip("ruff is not installed (pip install -r requirements-dev.txt)")
  done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format=concise", "."],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_no_binary_files_at_the_root():
  binary = []
  for path in ROOT.iterdir():
    if path.is_file() and b"\0" in path.read_bytes()[:8192]:
      binary.append(path.name)
    elif path.suffix in (".whl", ".zip", ".tar", ".gz", ".so"):
      binary.append(path.name)
  assert binary == []
