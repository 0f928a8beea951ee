"""Import boundaries (DESIGN §2): training and the held-out evaluator share only the public
description and the machinery that applies it, never each other's code."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bat_jax"

TRAINING_SIDE = ("train_tasks", "stagebank", "rollout", "grpo", "bicurl")
# What the evaluator may import of the package: the public description and shared machinery.
SHARED = ("workflow", "rubric", "sandbox", "markers", "taskkit", "io_utils")


def _resolve(node: ast.ImportFrom, path: pathlib.Path) -> str:
  """The absolute module of a `from ... import` (relative imports resolved against `path`)."""
  if not node.level:
    return node.module or ""
  try:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
  except ValueError:  # a file outside the repository: keep the name as written
    return node.module or ""
  base = parts[:-node.level]
  return ".".join(base + ([node.module] if node.module else []))


def _imports(path: pathlib.Path):
  """Every module name a file imports (plain, from, relative, importlib / __import__)."""
  tree = ast.parse(path.read_text(), filename=str(path))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = _resolve(node, path)
      yield base
      yield from (f"{base}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
        in ("import_module", "__import__") and node.args \
        and isinstance(node.args[0], ast.Constant):
      yield str(node.args[0].value)


def _offenders(files, forbidden):
  """(file, imported name) pairs that name any `forbidden` package (as a dotted component)."""
  return [(f.name, name) for f in files for name in _imports(f)
          if set(name.split(".")) & set(forbidden)]


def _files(*packages):
  files = []
  for package in packages:
    path = PACKAGE / package
    files += sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
  assert files and all(f.is_file() for f in files), packages
  return files


@pytest.mark.parametrize("package", ["train_tasks", "stagebank"])
def test_training_side_never_imports_the_evaluator(package):
  assert _offenders(_files(package), ("evaluator",)) == []


def test_evaluator_never_imports_the_training_side():
  assert _offenders(_files("evaluator"), TRAINING_SIDE) == []


def test_evaluator_imports_only_shared_machinery():
  allowed = {"bat_jax", *(f"bat_jax.{m}" for m in SHARED + ("evaluator",))}
  bad = [(f.name, name) for f in _files("evaluator") for name in _imports(f)
         if name.startswith("bat_jax") and not any(name == a or name.startswith(a + ".")
                                                   for a in allowed)]
  assert bad == []


def test_shared_machinery_imports_neither_side():
  files = _files("taskkit", "sandbox", "workflow", "rubric", "markers", "io_utils")
  assert _offenders(files, TRAINING_SIDE + ("evaluator",)) == []


def test_importing_the_evaluator_loads_no_training_code():
  """The transitive check: what `import bat_jax.evaluator` really loads."""
  code = ("import sys, bat_jax.evaluator, bat_jax.evaluator.__main__\n"
          f"side = {TRAINING_SIDE!r}\n"
          "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
          "[['bat_jax', s] for s in side]))\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       check=True).stdout
  assert out.strip() == "[]"


@pytest.mark.parametrize("line", ["import bat_jax.evaluator.cells",
                                  "from bat_jax.evaluator import generators",
                                  "from ..evaluator import firewall",
                                  "from bat_jax import evaluator",
                                  "importlib.import_module('bat_jax.evaluator')"])
def test_the_import_scan_catches_every_form(tmp_path, line):
  planted = tmp_path / "planted.py"
  planted.write_text(f"import importlib\n{line}\n")
  assert _offenders([planted], ("evaluator",)) != []


def test_relative_imports_resolve_against_the_package():
  """`from .. import train_tasks` inside bat_jax/evaluator/ names bat_jax.train_tasks."""
  node = ast.parse("from .. import train_tasks").body[0]
  assert _resolve(node, PACKAGE / "evaluator" / "x.py") == "bat_jax"
  planted = ast.parse("from ..train_tasks import base").body[0]
  assert _resolve(planted, PACKAGE / "evaluator" / "x.py") == "bat_jax.train_tasks"


def test_both_sides_send_the_public_system_prompt():
  """Training rows and held-out cells share the wording through workflow.py, not each other."""
  from bat_jax import workflow
  from bat_jax.evaluator import episode
  from bat_jax.evaluator.agents import Turn
  from bat_jax.rollout_protocol import RolloutLimits
  from bat_jax.stagebank import rl_rows

  seen = []

  def agent(messages):
    seen.append(messages[0])
    return Turn(())  # stop at once: the sandbox is never used

  counters = episode.drive_episode(agent, None, "brief", RolloutLimits())
  assert counters["finish_reason"] == "agent_stop"
  assert seen == [{"role": "system", "content": workflow.SYSTEM_PROMPT}]
  assert rl_rows.SYSTEM_PROMPT == workflow.SYSTEM_PROMPT
