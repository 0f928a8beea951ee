"""The source grid: focus {E2E, S1..S5} x 7 tracks x 3 outcomes = 126 abstract states.

Each state carries a short abstract condition: what situation a row of that state puts the agent
in, written only from the public workflow description (`bat_jax.workflow`). It never names a
benchmark task, file or value.
"""

from __future__ import annotations

import dataclasses

from bat_jax import workflow

# What each focus asks for (public stage descriptions).
_FOCUS_TEXT = {
    workflow.E2E: "Carry a {track} task through all five stages, from plan to submission",
    "S1": "Write a plan for a {track} task that covers framing, approach, resources and outputs",
    "S2": "Prepare the environment for a {track} task: check compatibility, load and declare the "
          "model checkpoint, write the pipeline script",
    "S3": "Validate the {track} pipeline on a small case: check the output shape and that the "
          "result is non-degenerate",
    "S4": "Run {track} inference over every case, persist the outputs and check coverage",
    "S5": "Assemble a task-native {track} submission, validate its schema and completeness, and "
          "hand it off",
}
# What the outcome bucket adds to the situation.
_OUTCOME_TEXT = {
    "success": "the inputs are sound, so the clean path succeeds.",
    "recovery": "something planted goes wrong on the way; diagnose it, run a verified correction "
                "and continue only once the result is sound.",
    "failure": "the task cannot be completed honestly; the right result is a truthful failure "
               "report, never fabricated outputs.",
}


@dataclasses.dataclass(frozen=True, order=True)
class GridState:
  """One abstract source state.

  Attributes:
    focus: `E2E` or a stage id S1..S5.
    track: one of `workflow.TRACKS`.
    outcome: one of `workflow.OUTCOMES`.
  """
  focus: str
  track: str
  outcome: str

  def __post_init__(self):
    if self.focus not in workflow.FOCI:
      raise ValueError(f"unknown focus {self.focus!r}; expected one of {workflow.FOCI}")
    if self.track not in workflow.TRACKS:
      raise ValueError(f"unknown track {self.track!r}; expected one of {workflow.TRACKS}")
    if self.outcome not in workflow.OUTCOMES:
      raise ValueError(f"unknown outcome {self.outcome!r}; expected one of {workflow.OUTCOMES}")

  @property
  def key(self) -> str:
    """A stable id such as `S3/segmentation/recovery`."""
    return f"{self.focus}/{self.track}/{self.outcome}"

  @property
  def condition(self) -> str:
    """The short abstract condition of this state (public workflow wording only)."""
    head = _FOCUS_TEXT[self.focus].format(track=self.track)
    return f"{head}; {_OUTCOME_TEXT[self.outcome]}"


SOURCE_GRID: tuple[GridState, ...] = tuple(
    GridState(f, t, o) for f in workflow.FOCI for t in workflow.TRACKS for o in workflow.OUTCOMES)
