"""The firewall: the aggregate report is the only thing that leaves the evaluator.

`check_report` walks a report against an allowlist, recursively, and raises `FirewallError`
naming the first offending field. Every leaf is a number, a count, a 64-hex digest or a value
from a fixed public vocabulary (stages, tracks, tiers, failure categories), so no free text --
task ids, questions, answers, labels, paths, traces, transcripts -- can ride along in any field.
`export_report` writes a report only after it passes.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from bat_jax import workflow
from bat_jax.io_utils import atomic_write_json

REPORT_SCHEMA = "bat_jax.evaluator.report/v2"  # v2: finish reasons max_turns, max_tool_calls
TIERS: tuple[str, ...] = ("lite", "standard", "external")
INVALID_REASONS: tuple[str, ...] = ("timeout", "crash", "parser_failure", "sandbox_error")
FAILURE_CATEGORIES: tuple[str, ...] = INVALID_REASONS + (
    "max_turns", "max_tool_calls", "malformed_turns", "no_submission", "task_failed") + tuple(
        f"no_evidence_{s}" for s in workflow.STAGES)
_HEX64 = re.compile(r"[0-9a-f]{64}")


class FirewallError(ValueError):
  """A report holds a field (or value) that must not cross the firewall."""


Rule = Callable[[Any, str], None]


def _fail(path: str, what: str) -> None:
  raise FirewallError(f"report field {path}: {what}")


def _score(value: Any, path: str) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
      or not 0.0 <= value <= 1.0:
    _fail(path, f"must be a score in [0, 1] or null, got {type(value).__name__} {value!r:.80}")


def _count(value: Any, path: str) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    _fail(path, f"must be a count (int >= 0), got {type(value).__name__} {value!r:.80}")


def _flag(value: Any, path: str) -> None:
  if not isinstance(value, bool):
    _fail(path, f"must be true or false, got {type(value).__name__}")


def _digest(value: Any, path: str) -> None:
  if not isinstance(value, str) or not _HEX64.fullmatch(value):
    _fail(path, "must be a 64-character lowercase hex digest")


def _one_of(options: tuple[str, ...]) -> Rule:
  def rule(value: Any, path: str) -> None:
    if value not in options:
      _fail(path, f"must be one of {list(options)}, got {value!r:.80}")
  return rule


def _score_list(value: Any, path: str) -> None:
  if not isinstance(value, list):
    _fail(path, f"must be a list of scores, got {type(value).__name__}")
  for i, v in enumerate(value):
    if v is None:
      _fail(f"{path}[{i}]", "must be a score in [0, 1], got null")
    _score(v, f"{path}[{i}]")


def _fields(spec: Mapping[str, Rule], optional: Optional[Mapping[str, Rule]] = None) -> Rule:
  """A mapping with exactly these keys, plus any of the `optional` ones."""
  optional = optional or {}

  def rule(value: Any, path: str) -> None:
    if not isinstance(value, Mapping):
      _fail(path, f"must be an object, got {type(value).__name__}")
    extra = sorted(str(k) for k in value if k not in spec and k not in optional)
    if extra:
      _fail(f"{path}.{extra[0]}", "is not an allowed field")
    missing = sorted(k for k in spec if k not in value)
    if missing:
      _fail(f"{path}.{missing[0]}", "is missing")
    for k, sub in spec.items():
      sub(value[k], f"{path}.{k}")
    for k, sub in optional.items():
      if k in value:
        sub(value[k], f"{path}.{k}")
  return rule


def _map(keys: tuple[str, ...], sub: Rule) -> Rule:
  """A mapping whose keys come from a fixed vocabulary."""
  def rule(value: Any, path: str) -> None:
    if not isinstance(value, Mapping):
      _fail(path, f"must be an object, got {type(value).__name__}")
    for k, v in value.items():
      if k not in keys:
        _fail(f"{path}.{str(k)[:80]}", "is not an allowed key")
      sub(v, f"{path}.{k}")
  return rule


_STAGE_SCORES = _fields({s: _score for s in workflow.STAGES})
# `cell_overall` and `cell_stage_scores` (optional): the track's per-cell overall and per-stage
# scores, for the paired noise of a round's changes (the gate's, the run report's). Scores only,
# in an order keyed by a digest of each cell (`aggregation`), the same in every report of one
# cell set; the order says nothing of a cell (not even its outcome bucket).
_TRACK_FIELDS = _fields({"overall": _score, "task": _score, "agentic": _score,
                         "stage_scores": _STAGE_SCORES, "cells": _count, "valid": _count},
                        optional={"cell_overall": _score_list,
                                  "cell_stage_scores": _fields({s: _score_list
                                                                for s in workflow.STAGES})})


def _TRACK(value: Any, path: str) -> None:  # noqa: N802  (a rule, named like the others)
  _TRACK_FIELDS(value, path)
  lists = {"cell_overall": value.get("cell_overall"),
           **{f"cell_stage_scores.{s}": scores
              for s, scores in value.get("cell_stage_scores", {}).items()}}
  for name, scores in lists.items():
    if scores is not None and len(scores) != value["cells"]:
      _fail(f"{path}.{name}", f"must list one score per cell ({value['cells']}), got "
            f"{len(scores)}")


REPORT_RULE: Rule = _fields({
    "schema": _one_of((REPORT_SCHEMA,)),
    "tier": _one_of(TIERS),
    "stage_scores": _STAGE_SCORES,
    "task_score": _score,
    "agentic": _score,
    "overall": _score,
    "track_scores": _map(workflow.TRACKS, _TRACK),
    "completion": _fields({"cells": _count, "valid": _count, "submitted": _count,
                           "agent_stopped": _count,
                           "stage_evidence": _fields({s: _count for s in workflow.STAGES})}),
    "failure_categories": _map(FAILURE_CATEGORIES, _count),
    "validity": _fields({"valid": _flag, "valid_cells": _count, "invalid_cells": _count}),
    "protocol_digest": _digest,
    "cell_set_digest": _digest,
})


def check_report(report: Any) -> None:
  """Raises FirewallError naming the first field the allowlist does not admit."""
  REPORT_RULE(report, "$")


def export_report(report: Mapping[str, Any], path: Path) -> Path:
  """Checks the report, then writes it atomically as JSON."""
  check_report(report)
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  atomic_write_json(str(path), dict(report))
  return Path(path)
