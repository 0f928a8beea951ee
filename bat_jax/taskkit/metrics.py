"""Per-track task metrics: one case's submitted prediction against its hidden truth, in [0, 1].

The metric names are public (`workflow.TASK_METRICS`); the truths are not. Training families and
the held-out evaluator both score with these functions.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Sequence

# Enhancement: a PSNR gain (dB) over the noisy input of this much or more scores 1.
TARGET_PSNR_GAIN_DB = 3.0
# Synthesis: the rendered foreground mean must be within this fraction of maxval.
SYNTH_LEVEL_TOLERANCE = 0.05


def _iou(a: list[int], b: list[int]) -> float:
  ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
  iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
  inter = ix * iy
  union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
  return inter / union if union else 0.0


def _flat(grid: Any) -> list[float]:
  return [float(v) for row in grid for v in row]


def psnr(pred: Any, ref: Any, maxval: int) -> float:
  """PSNR (dB) of grid `pred` against grid `ref`, capped at 99 for identical grids."""
  p, r = _flat(pred), _flat(ref)
  mse = sum((a - b) ** 2 for a, b in zip(p, r)) / len(r)
  return 99.0 if mse == 0 else 10.0 * math.log10(maxval ** 2 / mse)


def accuracy(truth: str, pred: Any) -> float:
  return float(isinstance(pred, str) and pred.strip().lower() == truth.strip().lower())


def dice(truth: Any, pred: Any) -> float:
  """Dice of binary masks [H][W]; two empty masks agree perfectly."""
  t, p = _flat(truth), _flat(pred)
  if len(t) != len(p):
    return 0.0
  inter = sum(1 for a, b in zip(t, p) if a and b)
  total = sum(1 for a in t if a) + sum(1 for b in p if b)
  return 1.0 if total == 0 else 2.0 * inter / total


def detection_f1(truth: list[list[int]], pred: Any) -> float:
  """F1 of predicted boxes against true [x0, y0, x1, y1] boxes, matched greedily at IoU >= 0.5."""
  boxes = [d["box"] for d in sorted(pred, key=lambda d: -d["score"])]
  unmatched = list(truth)
  hits = 0
  for box in boxes:
    best = max(unmatched, key=lambda t: _iou(t, box), default=None)
    if best is not None and _iou(best, box) >= 0.5:
      unmatched.remove(best)
      hits += 1
  if not truth and not boxes:
    return 1.0
  return 2.0 * hits / (len(truth) + len(boxes))


# Report findings fill three slots: the lesion count, the quadrant of the largest lesion and
# the impression (a phrase of the task's own vocabulary: `hidden["impressions"]`).
_COUNT = re.compile(r"\b\d+ lesion")
_QUADRANT = re.compile(r"\b(?:upper|lower) (?:left|right)\b")


def finding_f1(truth: list[str], pred: Any, impressions: Sequence[str] = ()) -> float:
  """F1 of the findings a report states against its key findings (precision and recall).

  A stated finding is a count, quadrant or impression phrase (`impressions` and the true one);
  it is correct when it is a key finding and its slot states nothing else, so a report hedging
  over several values of a slot earns nothing for that slot, and one listing every possible
  finding earns nothing at all.
  """
  text = pred.lower() if isinstance(pred, str) else ""
  keys = {k.lower() for k in truth}
  phrases = sorted({p.lower() for p in impressions} | {truth[-1].lower()}, key=len, reverse=True)
  slots = (_COUNT, _QUADRANT, re.compile("|".join(map(re.escape, phrases))))
  stated = [set(slot.findall(text)) for slot in slots]
  # Distinct findings, so a phrase two slots both match counts once: F1 stays within [0, 1].
  hits = len({v for s in stated if len(s) == 1 and s <= keys for v in s})
  return 0.0 if not hits else 2.0 * hits / (len(set().union(*stated)) + len(keys))


def psnr_gain(truth: Mapping[str, Any], pred: Any) -> float:
  """PSNR gain over the noisy input, relative to TARGET_PSNR_GAIN_DB, clipped to [0, 1]."""
  if len(_flat(pred)) != len(_flat(truth["clean"])):
    return 0.0
  gain = psnr(pred, truth["clean"], truth["maxval"]) - truth["noisy_psnr"]
  return min(1.0, max(0.0, gain / TARGET_PSNR_GAIN_DB))


def condition_fidelity(truth: Mapping[str, Any], pred: Any) -> float:
  """IoU of the rendered foreground with the requested shape, 0 if its level is off."""
  mask, p = _flat(truth["mask"]), _flat(pred)
  if len(mask) != len(p):
    return 0.0
  midpoint = (truth["fg"] + truth["bg"]) / 2.0
  fg = [v >= midpoint for v in p]
  inter = sum(1 for a, b in zip(mask, fg) if a and b)
  union = sum(1 for a, b in zip(mask, fg) if a or b)
  inside = [v for v, m in zip(p, mask) if m]
  level_ok = abs(sum(inside) / len(inside) - truth["fg"]) <= SYNTH_LEVEL_TOLERANCE * truth["maxval"]
  return inter / union if (union and level_ok) else 0.0


CASE_METRICS: Mapping[str, Callable[[Any, Any], float]] = {
    "classification": accuracy, "vqa": accuracy, "segmentation": dice,
    "detection": detection_f1, "report": finding_f1, "enhancement": psnr_gain,
    "synthesis": condition_fidelity}


def case_score(track: str, truth: Any, pred: Any, *, impressions: Sequence[str] = ()) -> float:
  """One case's score in [0, 1]; a malformed prediction scores 0 rather than raising.

  impressions: report only, the task's impression phrases (`hidden["impressions"]`), so a
  report stating several of them is not credited for the right one.
  """
  if track not in CASE_METRICS:
    raise ValueError(f"unknown track {track!r}; expected one of {sorted(CASE_METRICS)}")
  try:
    if track == "report":
      value = finding_f1(truth, pred, impressions)
    else:
      value = float(CASE_METRICS[track](truth, pred))
  except (TypeError, KeyError, ValueError, IndexError, ZeroDivisionError, OverflowError,
          AttributeError, RecursionError):
    return 0.0
  return value if 0.0 <= value <= 1.0 else 0.0  # NaN (from NaN pixels) scores 0
