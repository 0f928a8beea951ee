"""The paired promotion gate: promote a candidate only when every check passes.

`check(baseline, candidate, thresholds, training_healthy)` compares two aggregate reports of the
held-out evaluator, measured on the *same* cells. A report is a dict with (at least):

- `stage_scores`: `{"S1": x | None, ..., "S5": x | None}` (a missing stage is null);
- `task_score`: float | None;
- `overall`: float | None;
- `track_scores`: `{track: x | None}` or `{track: {"overall": x | None, ...}}`;
- a pairing digest: `protocol_digest` and/or `cell_set_digest`;
- optionally `validity: {"invalid_cells": n, ...}` (the built-in evaluator's report has it).

Pairing. Every digest either report carries must be present in both and equal, at least one
must be present, both must score the same tracks, and neither may have invalid cells (their
scores would then cover only part of the paired cell set); otherwise `UnpairedReportsError` (a
`ValueError`) names what differs. Comparing unpaired cells would make the gate meaningless.

Checks (value = drop = baseline - candidate; a negative drop is an improvement). Reference
thresholds (`GateThresholds` defaults, BaT release):

- `overall_drop` <= 0.01;
- `task_drop` <= 0.03;
- `track_drop/<track>` <= 0.05 for every track; with `track_noise_z` = z > 0 (not the
  reference: 0) the limit widens to 0.05 + z * SE, SE the standard error of the track's paired
  per-cell differences, when both reports carry the track's `cell_overall` (else the plain
  limit). Why: a track of n cells moves by 1/n of one cell's change, so at 6 cells a track one
  cell apart fails 0.05 by chance; the overall, task and stage checks (all cells) stay plain;
- `stage_drop/S3`, `/S4`, `/S5` <= 0.03;
- `catastrophic_overall_drop`: overall drop < 0.20 (strict);
- `training_healthy` is true.

Float representation: scores are averages, so a drop that is "exactly" a threshold can come out
a few ulps either side (0.80 - 0.79 = 0.010000000000000009). `tolerance` (default 1e-9, far below
any meaningful score difference) absorbs that: `drop <= limit` passes when
`drop <= limit + tolerance`, and the strict `drop < limit` passes when `drop < limit - tolerance`.

Nulls (missing evidence) are never read as zero. A score null on both sides is skipped (value
None, ok). Null in the baseline but scored in the candidate passes (nothing to regress from).
Scored in the baseline but null in the candidate fails closed: the candidate lost the evidence.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Optional, Union

from ml_collections import ConfigDict

from bat_jax import workflow
from bat_jax.stats import paired_differences, standard_error

PAIRING_DIGESTS: tuple[str, ...] = ("protocol_digest", "cell_set_digest")
Report = Mapping[str, Any]


class UnpairedReportsError(ValueError):
  """The two reports were not measured on the same cells."""


@dataclasses.dataclass(frozen=True)
class GateThresholds:
  """Gate limits on drops (baseline - candidate). Defaults are the BaT reference."""

  max_overall_drop: float = 0.01
  max_task_drop: float = 0.03
  max_track_drop: float = 0.05
  max_stage_drop: float = 0.03
  guarded_stages: tuple[str, ...] = ("S3", "S4", "S5")
  catastrophic_overall_drop: float = 0.20
  tolerance: float = 1e-9
  track_noise_z: float = 0.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name == "guarded_stages":
        unknown = [s for s in value if s not in workflow.STAGES]
        if unknown:
          raise ValueError(f"gate.guarded_stages: unknown stage(s) {unknown}; expected a subset "
                           f"of {workflow.STAGES}")
      elif not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"gate.{field.name}: must be a finite number >= 0, got {value!r}")

  @classmethod
  def from_config(cls, section: Union[ConfigDict, Mapping[str, Any]]) -> "GateThresholds":
    """Builds from the `gate` config section (same field names; unknown names are errors)."""
    values = section.to_dict() if isinstance(section, ConfigDict) else dict(section)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
      raise ValueError(f"gate: unknown field(s) {sorted(unknown)}; expected {sorted(names)}")
    if "guarded_stages" in values:
      values["guarded_stages"] = tuple(values["guarded_stages"])
    return cls(**values)


class Check(NamedTuple):
  """One gate check: the measured value (a drop, or a bool), its threshold, and the verdict."""
  value: Optional[Union[float, bool]]
  threshold: Union[float, bool]
  ok: bool


@dataclasses.dataclass(frozen=True)
class GateDecision:
  """`passed` is True only when every check is ok; `reasons` say why it held."""
  passed: bool
  checks: Mapping[str, Check]
  reasons: tuple[str, ...]

  def to_dict(self) -> dict[str, Any]:
    """JSON-able form for the run report."""
    return {"passed": self.passed, "reasons": list(self.reasons),
            "checks": {k: {"value": c.value, "threshold": c.threshold, "ok": c.ok}
                       for k, c in self.checks.items()}}


def _score(path: str, value: Any) -> Optional[float]:
  """A score or None; anything else (a string, a bool, NaN, inf) is an error naming `path`."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f"{path} must be a number or None, got {value!r}")
  if not math.isfinite(value):
    raise ValueError(f"{path} must be finite (use None for a null score), got {value!r}")
  return float(value)


def _field(report: Report, side: str, key: str) -> Any:
  if key not in report:
    raise ValueError(f"{side} report has no {key!r} field (has {sorted(report)})")
  return report[key]


def _track_score(side: str, track: str, value: Any) -> Optional[float]:
  if isinstance(value, Mapping):
    if "overall" not in value:
      raise ValueError(f"{side}.track_scores.{track} has no 'overall' score (has "
                       f"{sorted(value)})")
    value = value["overall"]
  return _score(f"{side}.track_scores.{track}", value)


def _check_paired(baseline: Report, candidate: Report) -> None:
  present = [k for k in PAIRING_DIGESTS if k in baseline or k in candidate]
  if not present:
    raise UnpairedReportsError(f"neither report carries a pairing digest {PAIRING_DIGESTS}; "
                               "cannot tell whether they were measured on the same cells")
  for key in present:
    if key not in baseline or key not in candidate:
      side = "baseline" if key not in baseline else "candidate"
      raise UnpairedReportsError(f"{side} report has no {key!r} while the other has one")
    if baseline[key] != candidate[key]:
      raise UnpairedReportsError(f"unpaired reports: {key} differs (baseline "
                                 f"{baseline[key]!r}, candidate {candidate[key]!r})")
  for side, report in (("baseline", baseline), ("candidate", candidate)):
    invalid = report.get("validity", {}).get("invalid_cells", 0)
    if invalid:
      raise UnpairedReportsError(f"{side} report has {invalid} invalid cell(s): its scores do "
                                 "not cover the paired cell set (re-run the evaluation)")
  base_tracks = set(_field(baseline, "baseline", "track_scores"))
  cand_tracks = set(_field(candidate, "candidate", "track_scores"))
  if base_tracks != cand_tracks:
    raise UnpairedReportsError(
        f"unpaired reports: tracks missing from candidate {sorted(base_tracks - cand_tracks)}, "
        f"missing from baseline {sorted(cand_tracks - base_tracks)}")
  unknown = sorted(base_tracks - set(workflow.TRACKS))
  if unknown:
    raise ValueError(f"track_scores: unknown track(s) {unknown}; expected {workflow.TRACKS}")


def _drop_check(name: str, base: Optional[float], cand: Optional[float], limit: float,
                tolerance: float, strict: bool, reasons: list[str]) -> Check:
  """`base - cand <= limit` (or `< limit` when strict), with nulls handled as documented."""
  if cand is None:
    if base is None:
      return Check(None, limit, True)
    reasons.append(f"{name}: scored {base:.4f} in the baseline but null in the candidate")
    return Check(None, limit, False)
  if base is None:
    return Check(None, limit, True)
  drop = base - cand
  ok = drop < limit - tolerance if strict else drop <= limit + tolerance
  if not ok:
    relation = ">=" if strict else ">"
    reasons.append(f"{name}: {drop:.4f} {relation} {limit:.6g} (baseline {base:.4f}, candidate "
                   f"{cand:.4f})")
  return Check(drop, limit, ok)


def _paired_se(side_lists: tuple[Any, Any]) -> Optional[float]:
  """SE of the mean paired difference of two per-cell score lists; None without a pairing."""
  base, cand = side_lists
  if not (isinstance(base, list) and isinstance(cand, list)):
    return None
  try:
    return standard_error(paired_differences(base, cand, "cell_overall"))
  except ValueError as e:
    raise UnpairedReportsError(str(e)) from None


def _track_drop_checks(baseline: Report, candidate: Report, thresholds: GateThresholds,
                       reasons: list[str]) -> dict[str, Check]:
  """`track_drop/<track>` for every track, the limit widened by `track_noise_z` paired SEs."""
  base_tracks, cand_tracks = baseline["track_scores"], candidate["track_scores"]
  checks = {}
  for track in sorted(base_tracks, key=workflow.TRACKS.index):
    name = f"track_drop/{track}"
    limit = thresholds.max_track_drop
    if thresholds.track_noise_z > 0:
      se = _paired_se(tuple(t[track].get("cell_overall") if isinstance(t[track], Mapping)
                            else None for t in (base_tracks, cand_tracks)))
      limit += thresholds.track_noise_z * (se or 0.0)
    checks[name] = _drop_check(name, _track_score("baseline", track, base_tracks[track]),
                               _track_score("candidate", track, cand_tracks[track]),
                               limit, thresholds.tolerance, False, reasons)
  return checks


def _stage_drop_checks(baseline: Report, candidate: Report, thresholds: GateThresholds,
                       reasons: list[str]) -> dict[str, Check]:
  """`stage_drop/S` for every guarded stage; unknown stage names are a ValueError."""
  base_stages = _field(baseline, "baseline", "stage_scores")
  cand_stages = _field(candidate, "candidate", "stage_scores")
  for side, stages in (("baseline", base_stages), ("candidate", cand_stages)):
    unknown = sorted(set(stages) - set(workflow.STAGES))
    if unknown:
      raise ValueError(f"{side}.stage_scores: unknown stage(s) {unknown}")
  checks = {}
  for stage in thresholds.guarded_stages:
    name = f"stage_drop/{stage}"
    checks[name] = _drop_check(
        name, _score(f"baseline.stage_scores.{stage}", base_stages.get(stage)),
        _score(f"candidate.stage_scores.{stage}", cand_stages.get(stage)),
        thresholds.max_stage_drop, thresholds.tolerance, False, reasons)
  return checks


def check(baseline: Report, candidate: Report, thresholds: GateThresholds,
          training_healthy: bool) -> GateDecision:
  """Runs every gate check on two paired aggregate reports.

  Args:
    baseline: the promoted policy's aggregate report.
    candidate: the new policy's aggregate report on the same cells.
    thresholds: the gate limits (`GateThresholds.from_config(cfg.gate)`).
    training_healthy: False when the round had non-finite updates or other training faults.

  Returns:
    The decision, with every check and the reasons it held.

  Raises:
    UnpairedReportsError: different digests or different track sets.
    ValueError: a malformed report (a missing field or a non-numeric score, named).
  """
  _check_paired(baseline, candidate)
  tol = thresholds.tolerance
  reasons: list[str] = []
  checks: dict[str, Check] = {}

  def get(report: Report, side: str, key: str) -> Optional[float]:
    return _score(f"{side}.{key}", _field(report, side, key))

  base_overall = get(baseline, "baseline", "overall")
  cand_overall = get(candidate, "candidate", "overall")
  checks["overall_drop"] = _drop_check("overall_drop", base_overall, cand_overall,
                                       thresholds.max_overall_drop, tol, False, reasons)
  checks["task_drop"] = _drop_check(
      "task_drop", get(baseline, "baseline", "task_score"),
      get(candidate, "candidate", "task_score"), thresholds.max_task_drop, tol, False, reasons)

  checks.update(_track_drop_checks(baseline, candidate, thresholds, reasons))
  checks.update(_stage_drop_checks(baseline, candidate, thresholds, reasons))

  checks["catastrophic_overall_drop"] = _drop_check(
      "catastrophic_overall_drop", base_overall, cand_overall,
      thresholds.catastrophic_overall_drop, tol, True, reasons)

  healthy = bool(training_healthy)
  checks["training_healthy"] = Check(healthy, True, healthy)
  if not healthy:
    reasons.append("training_healthy: the round's training was not healthy")
  return GateDecision(passed=all(c.ok for c in checks.values()), checks=checks,
                      reasons=tuple(reasons))
