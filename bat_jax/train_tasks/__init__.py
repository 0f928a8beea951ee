"""Training-side task families: generators, expert solvers, stage-boundary workspaces.

The machinery is shared with the held-out evaluator and lives in `bat_jax.taskkit`; this package
holds only the training side's own content -- its name pool and seed stream (`TRAIN_NAMES`), its
family instances (`FAMILIES`), its brief wording (`brief_for`) and the expert sweep over them --
and re-exports the machinery so callers keep one import.

Public API (see the contract in workflow.py):
  FAMILIES[track].generate(seed, outcome) -> TaskInstance   (the `code` action space)
  generate(track, seed, outcome, action_space) -> TaskInstance   (any action space)
  expert_actions(instance, stage) -> list[Action]
  materialize_at(instance, boundary_stage, root, sandbox_limits) -> Sandbox
  brief_for(instance, focus) -> str
"""

from bat_jax.taskkit import (Action, NamePool, TaskInstance, TrackFamily, expert_actions,
                             expert_episode, materialize_at, run_expert)
from bat_jax.train_tasks.briefs import brief_for
from bat_jax.train_tasks.families import FAMILIES, TRAIN_NAMES, generate

__all__ = ["FAMILIES", "TRAIN_NAMES", "Action", "NamePool", "TaskInstance", "TrackFamily",
           "brief_for", "expert_actions", "expert_episode", "generate", "materialize_at",
           "run_expert"]
