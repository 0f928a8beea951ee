"""experiments/compare_cells.py: the paired change of two policies' cells, and the kinds of
change, from the evaluator's per-cell records."""

import functools
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "compare_cells.py"
STAGES = ("S1", "S2", "S3", "S4", "S5")


@functools.cache
def _module():   # once: the script defines absl flags
  spec = importlib.util.spec_from_file_location("compare_cells", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _write(workdir: Path, policy: str, cells: dict) -> str:
  folder = workdir / "eval_records" / policy / "cells"
  folder.mkdir(parents=True)
  for name, (overall, s5, calls) in cells.items():
    record = {"overall": overall, "tool_calls": calls,
              "stage_scores": {s: (s5 if s == "S5" else 1.0) for s in STAGES}}
    (folder / f"{name}.json").write_text(json.dumps(record))
  return f"{workdir}:{policy}"


def test_compare_gives_paired_means_with_standard_errors_and_kinds_of_change(tmp_path):
  mod = _module()
  before = _write(tmp_path / "a", "sft", {"c1": (1.0, 1.0, 7), "c2": (0.5, 0.0, 5),
                                         "c3": (1.0, 1.0, 5), "c4": (0.4, 0.0, 3)})
  after = _write(tmp_path / "b", "round_000000", {"c1": (0.2, 0.0, 4), "c2": (1.0, 1.0, 5),
                                                  "c3": (0.6, 0.0, 5), "c4": (0.4, 0.0, 3)})
  result = mod.compare(mod.load_cells(before), mod.load_cells(after))
  assert result["cells"] == 4
  assert result["overall"]["mean"] == pytest.approx((-0.8 + 0.5 - 0.4 + 0.0) / 4)
  diffs = [-0.8, 0.5, -0.4, 0.0]
  mean = sum(diffs) / 4
  se = (sum((d - mean) ** 2 for d in diffs) / 3 / 4) ** 0.5
  assert result["overall"]["se"] == pytest.approx(se)
  assert result["S5"]["mean"] == pytest.approx((-1 + 1 - 1 + 0) / 4)
  assert result["S1"] == {"mean": 0.0, "se": 0.0}
  assert result["changed"] == {"lost, fewer calls": 1, "gained": 1, "lost, same calls": 1}
  text = mod.format_comparison(result)
  assert "overall -0.175" in text and "lost, fewer calls 1" in text


def test_compare_refuses_other_cells_and_names_a_missing_side(tmp_path):
  mod = _module()
  before = _write(tmp_path / "a", "sft", {"c1": (1.0, 1.0, 7), "c2": (0.5, 0.0, 5)})
  after = _write(tmp_path / "b", "r0", {"c1": (1.0, 1.0, 7), "c9": (0.5, 0.0, 5)})
  with pytest.raises(ValueError, match="not scored on the same cells"):
    mod.compare(mod.load_cells(before), mod.load_cells(after))
  with pytest.raises(FileNotFoundError, match="no cell records"):
    mod.load_cells(f"{tmp_path / 'a'}:round_000001")
  with pytest.raises(ValueError, match="not WORKDIR:POLICY"):
    mod.load_cells("runs-main12")
