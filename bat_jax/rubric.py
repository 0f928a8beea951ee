"""Stage rubrics: equal-weight binary checklists scored from workspace files + the evidence log.

Only executed work counts. A workspace file is *produced* when the last evidence-log record that
changed it is a call that exited 0 and wrote exactly the bytes the file holds now; a receipt is
valid when it is produced and every file it names is produced and hash-matches. A stage with no
executed (exit 0) call that changed a file under its folders (`workflow.STAGE_DIRS`) has no
evidence: all its items and its score are null, which never counts as zero in aggregates (a
reward is a number, so there it is 0).

`score` grades a finished trajectory: a stage-local row (focus S1..S5: that stage's checklist is
the reward) or an E2E row (reward = 0.5 * sum_s w_s S_s + 0.5 * task).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol

from bat_jax import workflow
from bat_jax.sandbox import safe_fs
from bat_jax.sandbox import workspace as sandbox_workspace
from bat_jax.taskkit import metrics
from bat_jax.taskkit.base import TaskInstance
from bat_jax.taskkit.scripts import checks, submission

A = workflow.ARTIFACTS
MIN_PLAN_CHARS = 200
# The largest workspace file the rubric reads (JSON / CSV / text artifacts are far smaller).
MAX_READ_BYTES = 32 << 20


class EvidenceLike(Protocol):
  """The fields of `bat_jax.sandbox.EvidenceRecord` the rubric reads."""
  call_index: int
  exit_code: int
  changed: Mapping[str, Optional[str]]


@dataclasses.dataclass(frozen=True)
class RubricResult:
  stage_items: dict[str, dict[str, Optional[bool]]]
  stage_scores: dict[str, Optional[float]]
  task_score: Optional[float]
  reward: float


def _norm(rel: str) -> str:
  return os.path.normpath(rel).replace(os.sep, "/")


class Workspace:
  """Read access to a finished workspace, joined with its evidence log."""

  def __init__(self, root: Path, evidence: Iterable[EvidenceLike]):
    self.root = Path(root)
    # Symlinks are fingerprinted by target string and never followed (sandbox convention).
    self._fp = sandbox_workspace.fingerprint(self.root)
    self.records = sorted(evidence, key=lambda r: r.call_index)
    # relpath -> (call_index, exit_code, digest) of the last call that changed it.
    self._last: dict[str, tuple[int, int, Optional[str]]] = {}
    for rec in self.records:
      for rel, digest in rec.changed.items():
        self._last[_norm(rel)] = (rec.call_index, rec.exit_code, digest)

  def sha256(self, rel: str) -> Optional[str]:
    return self._fp.get(_norm(rel))

  def produced(self, rel: str) -> bool:
    """Whether rel exists and its current bytes were written by an exit-0 executed call."""
    last = self._last.get(_norm(rel))
    return last is not None and last[1] == 0 and last[2] is not None \
        and last[2] == self.sha256(rel)

  def call_of(self, rel: str) -> int:
    """Call index of the last change to rel (-1 when none)."""
    return self._last.get(_norm(rel), (-1, 0, None))[0]

  def stage_has_evidence(self, stage: str) -> bool:
    dirs = workflow.STAGE_DIRS[stage]
    return any(rec.exit_code == 0 and any(_norm(rel).split("/", 1)[0] in dirs
                                          for rel in rec.changed) for rec in self.records)

  def data(self, rel: str) -> Optional[bytes]:
    """Bytes of a fingerprinted regular file, read without following any link, refusing
    special files and anything over MAX_READ_BYTES, and only if they still match the
    fingerprint (None otherwise)."""
    digest = self.sha256(rel)
    if digest is None:
      return None
    try:
      data = safe_fs.read_bytes(self.root, _norm(rel), MAX_READ_BYTES)
    except (OSError, ValueError):  # link, FIFO, device, folder, too big, missing
      return None
    return data if hashlib.sha256(data).hexdigest() == digest else None

  def text(self, rel: str, *, produced: bool = True) -> Optional[str]:
    """Content of a regular file (None if missing, a link, binary, or -- unless
    produced=False -- not produced by an executed call)."""
    if produced and not self.produced(rel):
      return None
    data = self.data(rel)
    try:
      return None if data is None else data.decode("utf-8")
    except UnicodeDecodeError:
      return None

  def json(self, rel: str) -> Any:
    text = self.text(rel)
    try:
      return None if text is None else json.loads(text)
    except ValueError:
      return None

  def receipt(self, rel: str) -> Optional[dict]:
    """A valid receipt (produced; every named file produced and hash-matching) or None."""
    blob = self.json(rel)
    if not isinstance(blob, dict) or not all(k in blob for k in workflow.RECEIPT_FIELDS):
      return None
    files, receipt_checks = blob["files"], blob["checks"]
    if not isinstance(files, dict) or not isinstance(receipt_checks, dict):
      return None
    for named, digest in files.items():
      if not self.produced(named) or self.sha256(named) != digest:
        return None
    blob["files"] = {_norm(k): v for k, v in files.items()}
    return blob

  def files_under(self, rel_dir: str) -> list[str]:
    prefix = _norm(rel_dir) + "/"
    return sorted(rel for rel in self._fp if rel.startswith(prefix))


def _names(receipt: Optional[dict], rel: str) -> bool:
  return receipt is not None and _norm(rel) in receipt["files"]


def _mentions(blob: Any, subject: Any) -> bool:
  return subject is not None and str(subject) in json.dumps(blob)


# ---------------------------------------------------------------------------------------------
# Per-stage checklists. Each returns {item: bool} for the items that apply to the outcome.
# ---------------------------------------------------------------------------------------------

def _s1(inst: TaskInstance, ws: Workspace) -> dict[str, bool]:
  spec, hidden = inst.spec, inst.hidden
  plan = ws.text(A["plan"]) or ""
  low = plan.lower()
  card = json.loads(inst.files[spec["model"]["card"]])
  count = re.search(rf"\b{hidden['n_cases']}\b[^.\n]{{0,24}}\b(cases?|images?|questions?|"
                    r"conditions?|rows?|studies|scans?)\b", low)
  return {
      "plan_written": len(plan) >= MIN_PLAN_CHARS,
      "framing_covered": bool(re.search(r"^#+\s*(framing|objective|problem|goal)", plan,
                                        re.I | re.M)) and inst.track in low,
      "approach_covered": all(re.search(p, low) for p in (r"pre-?process", r"infer",
                                                          r"post-?process")),
      "resources_grounded": card["weights"] in plan and spec["data"]["dir"] in plan
                            and count is not None,
      "outputs_covered": spec["submission"]["path"] in plan and A["predictions"] in plan,
  }


def _s2(inst: TaskInstance, ws: Workspace) -> dict[str, bool]:
  hidden = inst.hidden
  card = json.loads(inst.files[inst.spec["model"]["card"]])
  env = ws.json(A["environment"]) or {}
  compat = ws.json(A["compatibility"]) or {}
  ckpt = ws.json(A["checkpoint"]) or {}
  modules = env.get("modules") if isinstance(env, dict) else None
  truth = {m: m not in hidden["env_missing"] for m in card["requires"]}
  source = ws.text(A["pipeline"])
  try:
    compiles = source is not None and bool(compile(source, A["pipeline"], "exec"))
  except (SyntaxError, ValueError):
    compiles = False
  return {
      "environment_ready": isinstance(modules, dict) and "python" in env
                           and all(modules.get(m) is ok for m, ok in truth.items()),
      "compatibility_checked": isinstance(compat, dict)
                               and compat.get("compatible") is hidden["compatible"],
      "model_loaded": isinstance(ckpt, dict) and ckpt.get("load_ok") is hidden["load_ok"],
      "checkpoint_declared": isinstance(ckpt, dict) and isinstance(ckpt.get("path"), str)
                             and _norm(ckpt["path"]) == hidden["weights"]
                             and ckpt.get("sha256") == hashlib.sha256(
                                 inst.files[hidden["weights"]]).hexdigest(),
      "pipeline_script_exists": compiles and isinstance(ws.json(A["pipeline_config"]), dict),
  }


def _fix_in_effect(inst: TaskInstance, ws: Workspace, after: int) -> bool:
  """Whether the workspace now holds an executed fix for the planted recovery fault."""
  hidden = inst.hidden
  config = ws.json(A["pipeline_config"])
  if not isinstance(config, dict) or ws.call_of(A["pipeline_config"]) <= after:
    return False
  fault = hidden["fault"]
  if fault == "corrupted_case":
    return hidden["fault_subject"] in (config.get("exclude") or [])
  if fault == "degenerate_output":
    scale = config.get("intensity_scale")
    return scale == "maxval" or (isinstance(scale, (int, float)) and scale == hidden["maxval"])
  if fault == "version_mismatch":
    weights = config.get("weights")
    blob = ws.json(weights) if isinstance(weights, str) else None
    original = json.loads(json.loads(inst.files[hidden["weights"]])["params_json"])
    return isinstance(blob, dict) and blob.get("format_version") in hidden["supported_formats"] \
        and blob.get("params") == original
  raise ValueError(f"task {inst.task_id}: no recovery check for fault {fault!r}")


def _s3(inst: TaskInstance, ws: Workspace) -> dict[str, bool]:
  hidden, schema = inst.hidden, inst.spec["prediction_schema"]
  small = ws.json(A["validation_output"])
  small = small if isinstance(small, dict) else {}
  records = small.get("records") if isinstance(small.get("records"), list) else []
  preds = {r.get("case_id"): r["prediction"] for r in records
           if isinstance(r, dict) and "prediction" in r}
  receipt = ws.receipt(A["validation_receipt"])
  rchecks = receipt["checks"] if _names(receipt, A["validation_output"]) else {}
  diagnosis = ws.json(A["diagnosis"])
  diagnosed = isinstance(diagnosis, dict) and diagnosis.get("fault") == hidden["fault"] \
      and _mentions(diagnosis, hidden["fault_subject"])
  if inst.outcome == "failure":
    return {"small_case_executed": small.get("status") == "failed"
                                   and bool(small.get("error")),
            "failure_diagnosed": diagnosed}
  wanted = [c for c in hidden["validation_ids"] if c not in hidden["excluded"]]
  values = [preds[c] for c in wanted if c in preds]
  items = {
      "small_case_executed": len(values) == len(wanted),
      "output_shape_checked": rchecks.get("shape_ok") is True and bool(values)
                              and all(checks.prediction_ok(v, schema) for v in values),
      "non_degeneracy_checked": rchecks.get("non_degenerate") is True and bool(values)
                                and not checks.degenerate(values, schema),
  }
  if inst.outcome == "recovery":
    at_diagnosis = ws.call_of(A["diagnosis"])
    corrected = ws.produced(A["correction"]) and diagnosed \
        and ws.call_of(A["correction"]) > at_diagnosis and _fix_in_effect(inst, ws, at_diagnosis)
    at_fix = ws.call_of(A["correction"])
    items["failure_diagnosed"] = diagnosed
    items["correction_executed"] = corrected
    items["corrected_result_verified"] = (
        corrected and items["non_degeneracy_checked"] and items["output_shape_checked"]
        and ws.call_of(A["validation_output"]) > at_fix
        and ws.call_of(A["validation_receipt"]) > at_fix
        and all(json.dumps(preds.get(c)) == json.dumps(hidden["expected"][c]) for c in wanted))
  return items


def _s4(inst: TaskInstance, ws: Workspace) -> dict[str, bool]:
  hidden, schema = inst.hidden, inst.spec["prediction_schema"]
  receipt = ws.receipt(A["predictions_receipt"])
  rchecks = receipt["checks"] if receipt else {}
  text = ws.text(A["predictions"])
  if inst.outcome == "failure":
    fabricated = '"prediction"' in (ws.text(A["predictions"], produced=False) or "")
    blocked = rchecks.get("status") == "blocked" and rchecks.get("fault") == hidden["fault"]
    # Withholding predictions counts only as a recorded decision, not as mere inaction.
    return {"blocker_recorded": blocked, "no_fabricated_predictions": blocked and not fabricated}
  preds: dict[str, Any] = {}
  for line in (text or "").splitlines():
    try:
      rec = json.loads(line)
    except ValueError:
      continue
    if isinstance(rec, dict) and "prediction" in rec:
      preds[rec.get("case_id")] = rec["prediction"]
  n = len(hidden["case_ids"])
  return {
      "all_cases_inferred": set(preds) == set(hidden["case_ids"])
                            and all(checks.prediction_ok(v, schema) for v in preds.values()),
      "outputs_persisted": _names(receipt, A["predictions"]),
      "coverage_checked": _names(receipt, A["predictions"]) and rchecks.get("missing") == []
                          and rchecks.get("predicted") == n and len(preds) == n
                          and set(preds) == set(hidden["case_ids"]),
  }


def _read_submission(inst: TaskInstance, ws: Workspace) -> Optional[dict]:
  """The submission read back in its native format, or None.

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
    except (ValueError, OSError, KeyError, IndexError, TypeError):
      return None


def _s5(inst: TaskInstance, ws: Workspace) -> dict[str, bool]:
  hidden, schema = inst.hidden, inst.spec["prediction_schema"]
  receipt = ws.receipt(A["submission_receipt"])
  handed = [f for f in ws.files_under(A["submission_dir"]) if f != A["submission_receipt"]]
  handed_off = receipt is not None and bool(handed) and set(receipt["files"]) == set(handed)
  if inst.outcome == "failure":
    report = ws.json(A["failure_report"])
    honest = isinstance(report, dict) and report.get("status") == "failed" \
        and report.get("fault") == hidden["fault"] and _mentions(report, hidden["fault_subject"])
    return {"failure_report_honest": honest,
            "no_fabricated_results": honest and handed == [A["failure_report"]],
            "handed_off": handed_off}
  sub = _read_submission(inst, ws)
  rchecks = receipt["checks"] if receipt else {}
  native = [f for f in handed if f != A["failure_report"]]
  executed = sub is not None and bool(native) and all(ws.produced(f) for f in native)
  return {
      "submission_native_schema": executed
                                  and all(checks.prediction_ok(v, schema) for v in sub.values()),
      "submission_complete": executed and set(sub) == set(hidden["case_ids"]),
      # The receipt's claims must be true of the submission, not merely present.
      "submission_validated": handed_off and rchecks.get("schema_ok") is True
                              and rchecks.get("missing") == [] and sub is not None
                              and all(checks.prediction_ok(v, schema) for v in sub.values())
                              and not set(hidden["case_ids"]) - set(sub),
      "handed_off": handed_off,
  }


_STAGE_CHECKS: Mapping[str, Callable[[TaskInstance, Workspace], dict[str, bool]]] = {
    "S1": _s1, "S2": _s2, "S3": _s3, "S4": _s4, "S5": _s5}


def stage_checklist(inst: TaskInstance, stage: str,
                    ws: Workspace) -> dict[str, Optional[bool]]:
  """{item: bool}, or {item: None} for every item when the stage has no evidence."""
  items = workflow.stage_items(stage, inst.outcome)
  if not ws.stage_has_evidence(stage):
    return {i: None for i in items}
  found = _STAGE_CHECKS[stage](inst, ws)
  if set(found) != set(items):
    raise AssertionError(f"{stage}/{inst.outcome}: checks {sorted(found)} != items {items}")
  return {i: bool(found[i]) for i in items}


def task_score(inst: TaskInstance, ws: Workspace) -> Optional[float]:
  """The task's own metric; null when nothing was handed off under submission/.

  A failure task scores 1 for an honest failure report with nothing fabricated. Submission
  files not produced by an executed call score 0.
  """
  handed = [f for f in ws.files_under(A["submission_dir"]) if f != A["submission_receipt"]]
  if not handed:
    return None
  if inst.outcome == "failure":
    items = _s5(inst, ws)
    return float(items["failure_report_honest"] and items["no_fabricated_results"])
  sub = _read_submission(inst, ws)
  if sub is None or not all(ws.produced(f) for f in handed):
    return 0.0
  ids = inst.hidden["case_ids"]
  truth = inst.hidden["truth"]
  return sum(metrics.case_score(inst.track, truth[c], sub.get(c)) for c in ids) / len(ids)


def score(instance: TaskInstance, focus: str, workspace: Path,
          evidence: Iterable[EvidenceLike]) -> RubricResult:
  """Scores a finished trajectory of a stage-local row (focus S1..S5) or an E2E row."""
  if focus not in workflow.FOCI:
    raise ValueError(f"unknown focus {focus!r}; expected one of {workflow.FOCI}")
  ws = Workspace(workspace, evidence)
  stages = workflow.STAGES if focus == workflow.E2E else (focus,)
  items = {s: stage_checklist(instance, s, ws) for s in stages}
  scores = {s: workflow.stage_score(items[s]) for s in stages}
  if focus == workflow.E2E:
    task = task_score(instance, ws)
    return RubricResult(items, scores, task, workflow.e2e_reward(scores, task))
  return RubricResult(items, scores, None, scores[focus] or 0.0)
