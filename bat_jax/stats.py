"""Exact small statistics the gate and the run report share.

Sums are exactly rounded (`math.fsum`), so the order of the values cannot change the last bits:
a report's tracks come back from its JSON file sorted by name, and a rerun that reads the file
must report what the run that wrote it did.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence


def standard_error(values: Sequence[float]) -> Optional[float]:
  """Sample standard deviation / sqrt(n); None for fewer than two values."""
  if len(values) < 2:
    return None
  mean = math.fsum(values) / len(values)
  return (math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5


def paired_differences(before: Sequence[float], after: Sequence[float],
                       what: str = "per-cell scores") -> list[float]:
  """`after - before` cell by cell; lists of other lengths are not the same cells."""
  if len(before) != len(after):
    raise ValueError(f"{what}: lists differ in length ({len(before)} vs {len(after)}): not "
                     "the same cells")
  return [float(a) - float(b) for b, a in zip(before, after)]


def paired_change(before: Optional[Mapping[str, Sequence[float]]],
                  after: Optional[Mapping[str, Sequence[float]]],
                  what: str = "cell_overall") -> Optional[dict[str, Any]]:
  """Mean per-cell change `after - before` with its paired standard error, over every track
  both evaluations list per cell (`{track: per-cell scores}`, `what` names them in errors);
  None without per-cell scores."""
  if not before or not after or set(before) != set(after):
    return None
  diffs = [d for track in sorted(before)
           for d in paired_differences(before[track], after[track], f"{what}.{track}")]
  if not diffs:
    return None
  return {"mean": math.fsum(diffs) / len(diffs), "se": standard_error(diffs),
          "cells": len(diffs)}
