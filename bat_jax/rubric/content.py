"""Content checks: artifacts compared with what the task's model really produces.

A well-formed artifact is not enough: validation outputs, predictions and the submission must
hold the provided model's outputs (`hidden["expected"]`), so made-up files earn nothing.
Numbers match within CONTENT_ABS_TOL (the runners round scores to 4 decimals; JSON round-trips
them exactly); strings, labels, keys, list lengths and nesting must match exactly.
"""

from __future__ import annotations

import csv
import math
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

from bat_jax.rubric.workspace import Workspace
from bat_jax.sandbox import workspace as sandbox_workspace
from bat_jax.taskkit.base import TaskInstance
from bat_jax.taskkit.scripts import checks, submission

CONTENT_ABS_TOL = 1e-6
# What a task's submission reader or a schema check may raise on hostile input.
_READ_ERRORS = (ValueError, OSError, KeyError, IndexError, TypeError, AttributeError,
                OverflowError, RecursionError, MemoryError, csv.Error)


def same(got: Any, want: Any) -> bool:
  """Whether `got` equals the trusted value `want` (numbers within CONTENT_ABS_TOL)."""
  if isinstance(want, bool) or want is None:
    return got is want
  if isinstance(want, (int, float)):
    if isinstance(got, bool) or not isinstance(got, (int, float)):
      return False
    try:
      return math.isfinite(got) and abs(float(got) - float(want)) <= CONTENT_ABS_TOL
    except OverflowError:  # an int too large for a float
      return False
  if isinstance(want, str):
    return isinstance(got, str) and got == want
  if isinstance(want, (list, tuple)):
    return isinstance(got, list) and len(got) == len(want) and all(
        same(g, w) for g, w in zip(got, want))
  if isinstance(want, Mapping):
    return isinstance(got, dict) and set(got) == set(want) and all(
        same(got[k], want[k]) for k in want)
  raise TypeError(f"no content comparison for {type(want).__name__}")


def mismatched(got: Mapping[Any, Any], want: Mapping[str, Any]) -> list[str]:
  """Ids of `want` whose value in `got` is missing or differs (sorted)."""
  return sorted(k for k in want if k not in got or not same(got[k], want[k]))


def prediction_ok(pred: Any, schema: Mapping[str, Any]) -> bool:
  """`checks.prediction_ok` that never raises on a value of the wrong type."""
  try:
    return bool(checks.prediction_ok(pred, schema))
  except _READ_ERRORS:
    return False


def degenerate(preds: list[Any], schema: Mapping[str, Any]) -> bool:
  """`checks.degenerate` for predictions that passed `prediction_ok`; odd values: degenerate."""
  try:
    return bool(checks.degenerate(preds, schema))
  except _READ_ERRORS:
    return True


def predictions_of(records: Any) -> dict[Any, Any]:
  """{case_id: prediction} of parsed records `[{"case_id", "prediction"}, ...]` (others
  skipped; a case id must be a string)."""
  if not isinstance(records, list):
    return {}
  return {r["case_id"]: r["prediction"] for r in records
          if isinstance(r, dict) and isinstance(r.get("case_id"), str) and "prediction" in r}


def read_submission(inst: TaskInstance, ws: Workspace) -> Optional[dict]:
  """The submission read back in its native format, or None (reason noted).

  The task's reader runs on a private copy made through `Workspace.data`, so it never opens an
  agent-made path itself: a link, FIFO or oversized file under the submission makes it None.
  """
  spec = inst.spec["submission"]
  rels = ws.files_under(spec["path"]) or ([spec["path"]] if ws.sha256(spec["path"]) else [])
  copy = {rel: ws.data(rel) for rel in rels}
  if not copy or any(v is None for v in copy.values()):
    return None
  with tempfile.TemporaryDirectory(prefix="bat-rubric-") as tmp:
    try:
      sandbox_workspace.materialize(copy, Path(tmp))
      return submission.read_submission(spec, tmp)
    except _READ_ERRORS as e:
      ws.note(f"{spec['path']}: the submission does not read back ({type(e).__name__}: "
              f"{str(e)[:200]})")
      return None


def native(inst: TaskInstance, predictions: Mapping[str, Any]) -> dict:
  """`predictions` as the task's submission format reads them back (trusted values only)."""
  spec = inst.spec["submission"]
  with tempfile.TemporaryDirectory(prefix="bat-rubric-") as tmp:
    submission.write_submission(spec, dict(predictions), tmp)
    return submission.read_submission(spec, tmp)
