"""Aggregation: evaluator-side cell records -> the aggregate report (the only export).

Invalid cells score 0. An agent can make its own cells invalid (crash its worker, run a cell
past its budget), so leaving them out would let it drop the cells it would fail and lift the
aggregate; scoring them 0 makes the aggregate a lower bound that invalidity can only lower.
They are also counted under `validity` (valid coverage = valid_cells / cells) and
`failure_categories`, and `require_complete` refuses any report with one, so a gate never
decides on partial coverage. A score with no valid cell behind it at all is null. Scores are
means over cells of the per-cell values (`episode._scores`: a stage without evidence is 0 in an
end-to-end cell).
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
from typing import Any, Mapping, Optional, Sequence

from bat_jax import workflow
from bat_jax.evaluator.firewall import INVALID_REASONS, REPORT_SCHEMA, check_report

TASK_FAILED_BELOW = 0.5  # a valid cell whose task score is below this counts as task_failed


def _mean(values: Sequence[float]) -> Optional[float]:
  # Exactly rounded: cells finish in any order, and the report must not depend on it.
  return math.fsum(values) / len(values) if values else None


def _value(record: Mapping[str, Any], get: Any) -> float:
  """`get(record)`, or 0 for an invalid cell."""
  return float(get(record)) if record["valid"] else 0.0


def _scores(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Means over all records, an invalid one counting 0; null when none is valid."""
  if not any(r["valid"] for r in records):
    return {"stage_scores": {s: None for s in workflow.STAGES}, "task": None, "agentic": None,
            "overall": None}
  mean = lambda get: _mean([_value(r, get) for r in records])
  return {
      "stage_scores": {s: mean(lambda r: r["stage_scores"][s]) for s in workflow.STAGES},
      "task": mean(lambda r: r["task_score"]),
      "agentic": mean(lambda r: r["agentic"]),
      "overall": mean(lambda r: r["overall"]),
  }


def _cell_order(record: Mapping[str, Any]) -> str:
  """A per-cell sort key that reveals nothing of the cell: the digest of its descriptor."""
  return hashlib.sha256(json.dumps(record["cell"], sort_keys=True).encode()).hexdigest()


def per_cell_scores(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """`cell_overall` and, per stage, `cell_stage_scores`: one score per cell (an invalid cell 0)
  in the digest order, so two reports on one cell set list the same cells in the same places
  and the gate and the run report pair them for their noise estimates (a stage score moves by
  1/n of one cell's change)."""
  ordered = sorted(records, key=_cell_order)
  return {"cell_overall": [_value(r, lambda r: r["overall"]) for r in ordered],
          "cell_stage_scores": {s: [_value(r, lambda r: r["stage_scores"][s]) for r in ordered]
                                for s in workflow.STAGES}}


def failure_categories(record: Mapping[str, Any]) -> list[str]:
  """The failure categories one cell record falls under (firewall.FAILURE_CATEGORIES)."""
  if not record["valid"]:
    return [record["invalid_reason"]]
  found = [f"no_evidence_{s}" for s in workflow.STAGES if not record["stage_evidence"][s]]
  if record["finish_reason"] != "agent_stop":
    found.append(record["finish_reason"])
  if record["malformed_turns"]:
    found.append("malformed_turns")
  if not record["submitted"]:
    found.append("no_submission")
  if record["task_score"] < TASK_FAILED_BELOW:
    found.append("task_failed")
  return found


def aggregate(records: Sequence[Mapping[str, Any]], *, tier: str, protocol_digest: str,
              cell_set_digest: str) -> dict[str, Any]:
  """The aggregate report of a run (checked by the firewall before it is returned)."""
  valid = [r for r in records if r["valid"]]
  overall = _scores(records)
  tracks: dict[str, Any] = {}
  for track in workflow.TRACKS:
    mine = [r for r in records if r["cell"]["track"] == track]
    if not mine:
      continue
    scores = _scores(mine)
    tracks[track] = {**scores, "cells": len(mine), "valid": sum(r["valid"] for r in mine),
                     **per_cell_scores(mine)}
  categories = collections.Counter(c for r in records for c in failure_categories(r))
  report = {
      "schema": REPORT_SCHEMA, "tier": tier,
      "stage_scores": overall["stage_scores"], "task_score": overall["task"],
      "agentic": overall["agentic"], "overall": overall["overall"],
      "track_scores": tracks,
      "completion": {
          "cells": len(records), "valid": len(valid),
          "submitted": sum(r["submitted"] for r in valid),
          "agent_stopped": sum(r["finish_reason"] == "agent_stop" for r in valid),
          "stage_evidence": {s: sum(r["stage_evidence"][s] for r in valid)
                             for s in workflow.STAGES}},
      "failure_categories": dict(sorted(categories.items())),
      "validity": {"valid": len(valid) == len(records), "valid_cells": len(valid),
                   "invalid_cells": len(records) - len(valid)},
      "protocol_digest": protocol_digest, "cell_set_digest": cell_set_digest,
  }
  check_report(report)
  return report


def coverage_line(report: Mapping[str, Any]) -> str:
  """One line saying how many cells were valid and how invalid ones were counted."""
  v = report["validity"]
  cells = v["valid_cells"] + v["invalid_cells"]
  line = f"valid coverage: {v['valid_cells']}/{cells} cells"
  if v["invalid_cells"]:
    line += (f"; {v['invalid_cells']} invalid cell(s) scored 0 (a lower bound; a gate refuses "
             "this report)")
  return line


def require_complete(report: Mapping[str, Any], source: str = "evaluator") -> None:
  """Raises ValueError when a report has invalid cells or null scores (callers must stop)."""
  check_report(report)
  problems = []
  if not report["validity"]["valid"] or report["validity"]["invalid_cells"]:
    reasons = ", ".join(f"{k}={v}" for k, v in report["failure_categories"].items()
                        if k in INVALID_REASONS)
    problems.append(f"{report['validity']['invalid_cells']} invalid cell(s) ({reasons})")
  nulls = [k for k in ("task_score", "agentic", "overall") if report[k] is None]
  nulls += [f"stage_scores.{s}" for s, v in report["stage_scores"].items() if v is None]
  nulls += [f"track_scores.{t}.overall" for t, v in report["track_scores"].items()
            if v["overall"] is None]
  if nulls:
    problems.append(f"null score(s): {', '.join(nulls)}")
  if problems:
    raise ValueError(f"{source} report is not usable: {'; '.join(problems)}")
