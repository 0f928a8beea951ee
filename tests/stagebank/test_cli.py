"""`python -m bat_jax.stagebank build` as a process, and the bank's import boundary."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from bat_jax import markers
from bat_jax.stagebank import reader
from bat_jax.stagebank import shards

REPO = Path(__file__).resolve().parents[2]


def _cli(*args):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(REPO)]))
  return subprocess.run([sys.executable, "-m", "bat_jax.stagebank", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)


def test_build_cli_publishes_and_rejects(tmp_path):
  bank = tmp_path / "bank"
  weights = tmp_path / "w.json"
  weights.write_text(json.dumps({"pool_mix": {"s_target": 0.5, "s_mix": 0.25, "e2e": 0.25},
                                 "stage_weights": {"S1": 0.5, "S2": 0.5, "S3": 0, "S4": 0,
                                                   "S5": 0}}))
  common = ["--n-batches=2", "--source=synthetic_source:SyntheticSource"]
  done = _cli("build", "--round=5", f"--weights={weights}", f"--out={bank}", *common)
  assert done.returncode == 2 and "fails closed" in done.stderr  # no export: nothing published
  assert "Traceback" not in done.stderr and shards.published_rounds(bank) == []
  done = _cli("build", "--round=5", f"--weights={weights}", f"--out={bank}", *common,
              "--allow-no-markers")
  assert done.returncode == 0, done.stderr
  round_dir = Path(done.stdout.strip())
  assert round_dir == bank / "round_000005"
  batches = list(reader.RoundReader(round_dir))
  assert [r["extra_info"]["target_stage"] for r in batches[0][:4]] == ["S1", "S2", "S1", "S2"]

  export = tmp_path / "markers.json"
  export.write_text(json.dumps(markers.export_markers(["study workspace"], salt="cli")))
  done = _cli("build", "--round=6", "--target=S3", f"--out={bank}", f"--markers={export}",
              *common)
  assert done.returncode == 2
  assert "heldout_marker" in done.stderr and "study workspace" not in done.stderr
  assert shards.published_rounds(bank) == [5]


def test_stagebank_never_imports_the_evaluator():
  for path in (REPO / "bat_jax" / "stagebank").glob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
      assert not any("evaluator" in n for n in names), (path, names)


def test_sft_without_a_marker_export_says_how_to_make_one_in_one_line(tmp_path):
  done = _cli("sft", f"--out={tmp_path / 'sft'}")
  assert done.returncode == 2 and not (tmp_path / "sft").exists()
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1, done.stderr
  assert "python -m bat_jax.evaluator --markers-only --markers=PATH" in lines[0]
  assert "--markers=PATH" in lines[0] and "--allow-no-markers" in lines[0]
  done = _cli("sft", f"--out={tmp_path / 'sft'}", f"--markers={tmp_path / 'nope.json'}")
  assert done.returncode == 2 and "nope.json does not exist" in done.stderr
