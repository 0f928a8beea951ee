"""The public workflow contract shared by training and the held-out teacher.

Everything here is *public*: stage ids and weights, tracks, outcome buckets, the artifact paths
every task follows, the rubric item ids of each stage and the scoring formulas. Both sides
(tasks/, stagebank/ and evaluator/) import this module; nothing task-specific lives here.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

# ---------------------------------------------------------------------------------------------
# Stages, tracks, outcomes, pools.
# ---------------------------------------------------------------------------------------------

STAGES: tuple[str, ...] = ("S1", "S2", "S3", "S4", "S5")
STAGE_NAMES: Mapping[str, str] = {
    "S1": "plan", "S2": "setup", "S3": "validate", "S4": "infer", "S5": "submit"}
STAGE_WEIGHTS: Mapping[str, float] = {
    "S1": 0.25, "S2": 0.15, "S3": 0.35, "S4": 0.15, "S5": 0.10}
TRACKS: tuple[str, ...] = (
    "classification", "synthesis", "detection", "segmentation", "vqa", "report", "enhancement")
OUTCOMES: tuple[str, ...] = ("success", "recovery", "failure")
E2E = "E2E"
FOCI: tuple[str, ...] = (E2E,) + STAGES
POOLS: tuple[str, ...] = ("s_target", "s_mix", "e2e")

TASK_WEIGHT = 0.5      # overall = TASK_WEIGHT * task + AGENTIC_WEIGHT * agentic
AGENTIC_WEIGHT = 0.5

# ---------------------------------------------------------------------------------------------
# Artifact contract: workspace-relative paths every task follows. Inputs are given by the task;
# the agent produces the rest, each by an executed tool call (the evidence log proves it).
# ---------------------------------------------------------------------------------------------

ARTIFACTS: Mapping[str, str] = {
    # given
    "spec": "task/spec.json",                  # brief, track, input listing, submission schema
    "data_dir": "data",                        # input cases
    "model_dir": "models",                     # the provided "model" (stdlib-runnable weights)
    # S1 plan
    "plan": "plan/plan.md",
    # S2 setup
    "environment": "setup/environment.json",   # interpreter, modules checked
    "compatibility": "setup/compatibility.json",  # model version vs pipeline requirement
    "checkpoint": "setup/checkpoint.json",     # declared checkpoint: path + sha256
    "pipeline": "pipeline/infer.py",
    # S3 validate
    "validation_output": "validation/small_case.json",
    "validation_receipt": "validation/receipt.json",
    # S4 infer
    "predictions": "outputs/predictions.jsonl",
    "predictions_receipt": "outputs/receipt.json",
    # S5 submit
    "submission_dir": "submission",
    "submission_receipt": "submission/receipt.json",
    "failure_report": "submission/failure_report.json",  # honest failure (failure outcome)
}

# A receipt is JSON: {"stage": "S3", "files": {relpath: sha256_hex, ...}, "checks": {...}}.
# The rubric accepts a receipt only when every named file hashes to the recorded digest AND that
# digest was produced by an executed call (exit code 0) recorded in the sandbox evidence log.

# ---------------------------------------------------------------------------------------------
# Rubric items: each stage is an equal-weight checklist of binary items. Items marked with an
# outcome only apply to tasks of that outcome bucket; the rest apply to all.
# ---------------------------------------------------------------------------------------------

STAGE_ITEMS: Mapping[str, tuple[str, ...]] = {
    "S1": ("plan_written", "framing_covered", "approach_covered", "resources_grounded",
           "outputs_covered"),
    "S2": ("environment_ready", "compatibility_checked", "model_loaded", "checkpoint_declared",
           "pipeline_script_exists"),
    "S3": ("small_case_executed", "output_shape_checked", "non_degeneracy_checked",
           "failure_diagnosed", "correction_executed", "corrected_result_verified"),
    "S4": ("all_cases_inferred", "outputs_persisted", "coverage_checked"),
    "S5": ("submission_native_schema", "submission_complete", "submission_validated",
           "handed_off"),
}
# Items that apply only to some outcome buckets (all others apply to every bucket).
ITEM_OUTCOMES: Mapping[str, tuple[str, ...]] = {
    "failure_diagnosed": ("recovery", "failure"),
    "correction_executed": ("recovery",),
    "corrected_result_verified": ("recovery",),
}


def stage_items(stage: str, outcome: str) -> tuple[str, ...]:
  """The rubric items of `stage` that apply to a task of `outcome`."""
  if stage not in STAGE_ITEMS:
    raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
  if outcome not in OUTCOMES:
    raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
  return tuple(i for i in STAGE_ITEMS[stage] if outcome in ITEM_OUTCOMES.get(i, OUTCOMES))


# ---------------------------------------------------------------------------------------------
# Scoring. Missing evidence is None (null), never zero; nulls never enter aggregation.
# ---------------------------------------------------------------------------------------------

def _is_null(x: Optional[float]) -> bool:
  return x is None or (isinstance(x, float) and math.isnan(x))


def stage_score(item_results: Mapping[str, Optional[bool]]) -> Optional[float]:
  """Equal-weight mean of the binary items that were scored; None when none were."""
  scored = [bool(v) for v in item_results.values() if v is not None]
  return sum(scored) / len(scored) if scored else None


def agentic_score(stage_scores: Mapping[str, Optional[float]]) -> Optional[float]:
  """sum_s w_s * S_s over the stages that apply, weights renormalised; None if none apply."""
  for s in stage_scores:
    if s not in STAGE_WEIGHTS:
      raise ValueError(f"unknown stage {s!r} in stage_scores; expected {STAGES}")
  live = {s: v for s, v in stage_scores.items() if not _is_null(v)}
  if not live:
    return None
  total = sum(STAGE_WEIGHTS[s] for s in live)
  return sum(STAGE_WEIGHTS[s] * float(v) for s, v in live.items()) / total


def overall_score(task: Optional[float], agentic: Optional[float]) -> Optional[float]:
  """overall = 0.5 * task + 0.5 * agentic. A null side drops out (renormalised)."""
  parts = [(TASK_WEIGHT, task), (AGENTIC_WEIGHT, agentic)]
  live = [(w, float(v)) for w, v in parts if not _is_null(v)]
  if not live:
    return None
  return sum(w * v for w, v in live) / sum(w for w, _ in live)


def e2e_reward(stage_scores: Mapping[str, Optional[float]], task: Optional[float]) -> float:
  """E2E RL reward = 0.5 * agentic + 0.5 * task; a null side counts as 0 for a reward."""
  agentic = agentic_score(stage_scores)
  return AGENTIC_WEIGHT * (agentic or 0.0) + TASK_WEIGHT * (task or 0.0)


# The single tool the agent has. Its observation format is fixed.
TOOL_NAME = "execute_code"
TOOL_LANGUAGES: tuple[str, ...] = ("python", "bash")
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run code in the task workspace sandbox (no network; only the workspace "
                       "is writable). Returns exit_code, stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {
                "language": {"type": "string", "enum": list(TOOL_LANGUAGES)},
                "code": {"type": "string"},
            },
            "required": ["language", "code"],
        },
    },
}
MAX_OBSERVATION_CHARS = 2048


def format_observation(exit_code: int, stdout: str, stderr: str,
                       max_chars: int = MAX_OBSERVATION_CHARS) -> str:
  """`exit_code=..\\nstdout:..\\nstderr:..`, cut to max_chars with a visible marker."""
  text = f"exit_code={exit_code}\nstdout:{stdout}\nstderr:{stderr}"
  if len(text) <= max_chars:
    return text
  marker = f"\n...[truncated {len(text) - max_chars} chars]"
  return text[: max(0, max_chars - len(marker))] + marker
