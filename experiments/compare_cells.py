"""Paired per-cell comparison of two evaluated policies, and what the changed cells did.

    python experiments/compare_cells.py --before=runs/main12:sft --after=runs/fork:round_000000

Each side is `WORKDIR:POLICY`, read from `WORKDIR/eval_records/POLICY/cells/*.json` (the
evaluator's per-cell records; forks of one cold start share its held-out cells). Prints the
mean change of overall and of each stage with its paired standard error, then the changed
cells by kind: a loss with fewer tool calls (the episode stopped sooner), with the same number
(a call went wrong), with more, and the gains. Both sides must hold the same cells.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any

from absl import app, flags

from bat_jax import stats, workflow

_BEFORE = flags.DEFINE_string("before", None, "WORKDIR:POLICY, e.g. runs/main12:sft")
_AFTER = flags.DEFINE_string("after", None, "WORKDIR:POLICY, e.g. runs/fork:round_000000")


def load_cells(side: str) -> dict[str, dict[str, Any]]:
  """`{cell file name: record}` of `WORKDIR:POLICY`; a side without cells is an error."""
  workdir, sep, policy = side.rpartition(":")
  if not sep or not workdir or not policy:
    raise ValueError(f"{side!r} is not WORKDIR:POLICY")
  folder = Path(workdir) / "eval_records" / policy / "cells"
  cells = {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
  if not cells:
    raise FileNotFoundError(f"{side}: no cell records under {folder}")
  return cells


def compare(before: dict[str, dict], after: dict[str, dict]) -> dict[str, Any]:
  """Mean paired change (overall and per stage, each with its standard error) and the changed
  cells counted by kind."""
  if set(before) != set(after):
    only = sorted(set(before) ^ set(after))
    raise ValueError(f"the two policies were not scored on the same cells: {len(only)} differ, "
                     f"e.g. {only[:3]}")
  names = sorted(before)

  def change(score) -> dict[str, Any]:   # the report's own paired statistic, one "track"
    result = stats.paired_change({"cells": [score(before[n]) for n in names]},
                                 {"cells": [score(after[n]) for n in names]})
    return {"mean": result["mean"], "se": result["se"]}

  out = {"cells": len(names), "overall": change(lambda c: c["overall"])}
  for stage in workflow.STAGES:
    out[stage] = change(lambda c, s=stage: c["stage_scores"][s])
  kinds = collections.Counter()
  for n in names:
    b, a = before[n], after[n]
    if a["overall"] == b["overall"]:
      continue
    if a["overall"] > b["overall"]:
      kinds["gained"] += 1
    else:
      calls = a["tool_calls"] - b["tool_calls"]
      kinds["lost, fewer calls" if calls < 0 else "lost, more calls" if calls > 0
            else "lost, same calls"] += 1
  out["changed"] = dict(kinds)
  return out


def format_comparison(result: dict[str, Any]) -> str:
  def fmt(c):
    se = "n/a" if c["se"] is None else f"{c['se']:.3f}"
    return f"{c['mean']:+.3f} ± {se}"
  stages = "  ".join(f"{s} {fmt(result[s])}" for s in workflow.STAGES)
  kinds = ", ".join(f"{k} {v}" for k, v in sorted(result["changed"].items())) or "none"
  return (f"{result['cells']} cells: overall {fmt(result['overall'])}\n  {stages}\n"
          f"  changed cells: {kinds}")


def main(argv) -> None:
  del argv
  if not _BEFORE.value or not _AFTER.value:
    sys.exit("--before and --after are required (WORKDIR:POLICY)")
  print(format_comparison(compare(load_cells(_BEFORE.value), load_cells(_AFTER.value))))


if __name__ == "__main__":
  app.run(main)
