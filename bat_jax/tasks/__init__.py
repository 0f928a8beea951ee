"""Training-side task families: generators, expert solvers, stage-boundary workspaces.

Public API (see the contract in workflow.py):
  FAMILIES[track].generate(seed, outcome) -> TaskInstance
  expert_actions(instance, stage) -> list[Action]
  materialize_at(instance, boundary_stage, root, sandbox_limits) -> Sandbox
  brief_for(instance, focus) -> str
"""

from bat_jax.tasks.base import (TRAIN_NAMES, NamePool, TaskInstance, TrackFamily, brief_for)
from bat_jax.tasks.expert import Action, expert_actions
from bat_jax.tasks.families import FAMILIES
from bat_jax.tasks.episodes import expert_episode, materialize_at, run_expert

__all__ = ["FAMILIES", "TRAIN_NAMES", "Action", "NamePool", "TaskInstance", "TrackFamily",
           "brief_for", "expert_actions", "expert_episode", "materialize_at", "run_expert"]
