"""Task-family machinery shared by training (`bat_jax.train_tasks`) and the held-out evaluator.

Public, content-free machinery that applies the workflow contract: the family protocol and the
generic workspace builder (`base`), the per-track sampling logic parameterised by a name pool
and seed stream (`families`), the expert solver (`expert`), stage-boundary workspaces and expert
episodes (`episodes`), task metrics (`metrics`), and the stdlib code shipped into workspaces
(`runners/`, `scripts/`, assembled by `sources`), and the `stage_tools` action space
(`toolspace`: the stage CLIs a workspace ships, the facts line briefs quote, the tool expert).
Neither side's vocabulary, seed stream or wording lives here: each binds
`FAMILY_TYPES[track](names, write_brief)` to its own.

Public API:
  NamePool, TaskInstance, TrackFamily, BriefWriter, CaseData, SampleContext, FAMILY_TYPES
  expert_actions(instance, stage) -> list[Action]
  materialize_at(instance, boundary_stage, root, sandbox_limits) -> Sandbox
  expert_episode(instance, focus, root, sandbox_limits) -> EpisodeResult; run_expert(...)
"""

from bat_jax.taskkit.base import (BriefWriter, CaseData, NamePool, SampleContext, TaskInstance,
                                  TrackFamily)
from bat_jax.taskkit.episodes import expert_episode, materialize_at, run_expert
from bat_jax.taskkit.expert import Action, expert_actions
from bat_jax.taskkit.families import FAMILY_TYPES

__all__ = ["FAMILY_TYPES", "Action", "BriefWriter", "CaseData", "NamePool", "SampleContext",
           "TaskInstance", "TrackFamily", "expert_actions", "expert_episode", "materialize_at",
           "run_expert"]
