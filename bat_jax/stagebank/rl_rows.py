"""RL rows: reset points, not demonstrations.

An RL row holds the prompt (system + user only), the row's ids (state_id, target stage, pool,
track, outcome), the reward contract (rubric item ids from `bat_jax.workflow`), a workspace recipe
(generator, seed, outcome, stage boundary: enough to rebuild the workspace, never the files) and
provenance digests. It never holds an assistant turn, an answer, a teacher trajectory, or any
model-specific tool-call syntax; its shape follows the reference `grpo-prompt-row.json`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Protocol

from bat_jax import workflow
from bat_jax.stagebank.grid import GridState
from bat_jax.stagebank.rounds import DATA_SOURCE, RowSlot

ROW_SCHEMA_VERSION = 1
PROVENANCE_SOURCE = "stagebank_synthetic"

SYSTEM_PROMPT = workflow.SYSTEM_PROMPT  # public wording, shared with the evaluator


@dataclasses.dataclass(frozen=True)
class TaskDescription:
  """What the bank needs to know of one generated training task.

  Attributes:
    generator: the generator's id (e.g. `bat_jax.train_tasks/segmentation`).
    task_id: the training task's id.
    brief: the row's user message: the task brief scoped to the row's focus.
    workspace_sha256: digest of the task's initial workspace files.
    action_space: the task's action space (`workflow.ACTION_SPACES`).
  """
  generator: str
  task_id: str
  brief: str
  workspace_sha256: str
  action_space: str = "code"


class TaskSource(Protocol):
  """Where task content comes from (the training task families; never the evaluator)."""
  name: str

  def describe(self, track: str, outcome: str, seed: int, focus: str) -> TaskDescription:
    """The task of (track, outcome, seed), its brief scoped to `focus` (E2E or S1..S5)."""
    ...


def reward_contract(focus: str, outcome: str) -> dict[str, Any]:
  """The rubric the row is scored by: one stage's checklist, or the E2E combination."""
  if focus == workflow.E2E:
    return {
        "mode": "e2e_contract",
        "rubric": "bat_jax.rubric",
        "target_stage": workflow.E2E,
        "items": {s: list(workflow.stage_items(s, outcome)) for s in workflow.STAGES},
        "stage_weights": dict(workflow.STAGE_WEIGHTS),
        "task_weight": workflow.TASK_WEIGHT,
        "agentic_weight": workflow.AGENTIC_WEIGHT,
    }
  return {"mode": "rubric_contract", "rubric": "bat_jax.rubric", "target_stage": focus,
          "items": list(workflow.stage_items(focus, outcome))}


def rl_row(slot: RowSlot, task: TaskDescription, *, round_index: int,
           round_target: str) -> dict[str, Any]:
  """One RL reset-point row."""
  state = GridState(slot.stage, slot.track, slot.outcome)
  return {
      "schema_version": ROW_SCHEMA_VERSION,
      "data_source": DATA_SOURCE,
      "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                 {"role": "user", "content": task.brief}],
      "ability": f"bat:{slot.stage}",
      "reward_model": {"style": "custom"},
      "extra_info": {
          "state_id": slot.state_id,
          "round": round_index,
          "round_target": round_target,
          "target_stage": slot.stage,
          "focus_stage": slot.stage,
          "source_pool": slot.pool,
          "pool_index": slot.index,
          "outcome_bucket": slot.outcome,
          "track": slot.track,
          "assistant_target_included": False,
          "teacher_trajectory_included": False,
          "rollout_transcript_reuse_allowed": False,
          "model_specific_serialization": False,
          "reward_contract": reward_contract(slot.stage, slot.outcome),
          "workspace_recipe": {
              "generator": task.generator,
              "track": slot.track,
              "outcome": slot.outcome,
              "seed": slot.task_seed,
              "boundary_stage": slot.stage,  # E2E: a fresh workspace, as for S1
              "action_space": task.action_space,
          },
          "provenance": {
              "source": PROVENANCE_SOURCE,
              "task_source": task.generator,
              "clean_split": True,
              "grid_state": state.key,
              "condition": state.condition,
              "task_id": task.task_id,
              "source_digest": task.workspace_sha256,
              "prompt_sha256": hashlib.sha256(
                  (SYSTEM_PROMPT + "\x00" + task.brief).encode("utf-8")).hexdigest(),
          },
      },
  }
