"""The bank's task source: the training task families of `bat_jax.train_tasks` (never the
evaluator's)."""

from __future__ import annotations

import hashlib
import importlib
from typing import Any, Callable, Mapping

from bat_jax.stagebank.rl_rows import TaskDescription, TaskSource

DEFAULT_SOURCE = "bat_jax.stagebank.task_source:TasksPackageSource"


def files_digest(files: Mapping[str, bytes | str]) -> str:
  """sha256 over (relpath, sha256(content)) of a workspace's files, in path order."""
  h = hashlib.sha256()
  for rel in sorted(files):
    content = files[rel]
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    h.update(f"{rel}\x00{hashlib.sha256(data).hexdigest()}\n".encode("utf-8"))
  return h.hexdigest()


class TasksPackageSource:
  """Describes rows with `bat_jax.train_tasks`: `generate(track, seed, outcome, action_space)` and
  the focus-scoped user message `brief_for(instance, focus)`."""
  name = "bat_jax.train_tasks"

  def __init__(self, action_space: str = "code"):
    # deferred: the bank's CLI imports this module before it is needed
    from bat_jax import train_tasks
    from bat_jax import workflow
    self._tasks = train_tasks
    self.action_space = workflow.check_action_space(action_space)

  def describe(self, track: str, outcome: str, seed: int, focus: str) -> TaskDescription:
    return self.describe_with_files(track, outcome, seed, focus)[0]

  def describe_with_files(self, track: str, outcome: str, seed: int,
                          focus: str) -> tuple[TaskDescription, Mapping[str, bytes | str]]:
    """`describe`, and the initial workspace files its `workspace_sha256` is the digest of."""
    if track not in self._tasks.FAMILIES:
      raise ValueError(f"bat_jax.train_tasks has no family for track {track!r}")
    instance = self._tasks.generate(track, seed, outcome, self.action_space)
    return TaskDescription(generator=f"{self.name}/{track}", task_id=instance.task_id,
                           brief=self._tasks.brief_for(instance, focus),
                           workspace_sha256=files_digest(instance.files),
                           action_space=self.action_space), instance.files


def stage_tools_source() -> TasksPackageSource:
  """The training tasks in the `stage_tools` action space (`--source` of the bank's CLI)."""
  return TasksPackageSource("stage_tools")


def source_spec(action_space: str) -> str:
  """The `--source` factory spec of the bank's CLI for an action space."""
  return DEFAULT_SOURCE if action_space == "code" else f"{__name__}:stage_tools_source"


def load_source_factory(spec: str) -> Callable[[], TaskSource]:
  """Resolves `module:attr` (a TaskSource class or zero-argument function) for the CLI."""
  module, sep, attr = spec.partition(":")
  if not sep or not module or not attr:
    raise ValueError(f"task source {spec!r} must be module:attr")
  try:
    return getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"task source {spec!r} cannot be imported: {e}") from None


def instance_for(row: Mapping[str, Any]) -> Any:
  """Regenerates the training task an RL row's workspace recipe names, checking its digest.

  Raises:
    ValueError: naming the row's state_id when the recipe is not a `bat_jax.train_tasks` one or the
      regenerated workspace differs from the row's `source_digest` (the generator changed since
      the round was built: its rewards would not match its prompt).
  """
  from bat_jax import train_tasks
  info = row["extra_info"]
  recipe = info["workspace_recipe"]
  if recipe["generator"] != f"{TasksPackageSource.name}/{recipe['track']}":
    raise ValueError(f"row {info['state_id']}: workspace_recipe generator "
                     f"{recipe['generator']!r} is not a bat_jax.train_tasks family")
  instance = train_tasks.generate(recipe["track"], recipe["seed"], recipe["outcome"],
                                  recipe.get("action_space", "code"))
  digest = files_digest(instance.files)
  if digest != info["provenance"]["source_digest"]:
    raise ValueError(f"row {info['state_id']}: regenerated workspace digest {digest} differs "
                     f"from provenance.source_digest {info['provenance']['source_digest']}")
  return instance
