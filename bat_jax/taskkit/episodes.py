"""Stage-boundary workspaces and expert episodes, executed for real in the sandbox.

`materialize_at` builds the workspace a stage-local row starts from: the task's initial files,
then the expert's actions for every earlier stage executed in the sandbox (so handoff artifacts
are genuine and the rubric stays honest), then a fresh evidence log for the agent. Snapshots of
boundaries can be cached per task so a sweep or the Stage Bank does not re-run earlier stages.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from bat_jax import rubric, workflow
from bat_jax.sandbox import ExecResult, Sandbox, SandboxLimits, materialize
from bat_jax.taskkit.base import TaskInstance
from bat_jax.taskkit.expert import expert_actions

WORKSPACE = "workspace"
EVIDENCE = "evidence.jsonl"           # the agent's log (fresh at the boundary)
HANDOFF_EVIDENCE = "handoff_evidence.jsonl"  # the expert's earlier-stage calls


class ExpertActionFailed(RuntimeError):
  """An expert action exited non-zero: the generator, expert or sandbox is broken."""


def stages_before(boundary: str) -> tuple[str, ...]:
  """Stages done before a row with focus `boundary` starts (none for E2E and S1)."""
  if boundary not in workflow.FOCI:
    raise ValueError(f"unknown stage boundary {boundary!r}; expected one of {workflow.FOCI}")
  return () if boundary == workflow.E2E else workflow.STAGES[:workflow.STAGES.index(boundary)]


def stages_of(focus: str) -> tuple[str, ...]:
  """Stages a row with this focus asks for: all for E2E, else that one stage."""
  stages_before(focus)  # validates
  return workflow.STAGES if focus == workflow.E2E else (focus,)


def run_expert(sandbox: Sandbox, instance: TaskInstance, stages: tuple[str, ...],
               *, skip: tuple[str, ...] = ()) -> list[ExecResult]:
  """Executes the expert's actions for `stages` (minus `skip`) in order; raises on failure."""
  results = []
  for stage in stages:
    if stage in skip:
      continue
    for n, action in enumerate(expert_actions(instance, stage)):
      args = action["arguments"]
      res = sandbox.execute(args["language"], args["code"])
      results.append(res)
      if res.exit_code != 0 and not skip:
        raise ExpertActionFailed(f"{instance.task_id} {stage} action {n} exited {res.exit_code}:"
                                 f"\n{res.observation}")
  return results


def _snapshot_path(cache_dir: Path, instance: TaskInstance, stage: str) -> Path:
  return Path(cache_dir) / instance.task_id / f"after_{stage}"


def _save_snapshot(workspace: Path, target: Path) -> None:
  """Copies a workspace snapshot atomically (tmp folder + rename), keeping links as links."""
  if target.exists():
    return
  target.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
  shutil.copytree(workspace, tmp / "t", symlinks=True)
  try:
    os.replace(tmp / "t", target)
  except OSError:  # another process cached it first
    shutil.rmtree(tmp / "t")
  tmp.rmdir()


def materialize_at(instance: TaskInstance, boundary_stage: str, root: Path,
                   sandbox_limits: SandboxLimits = SandboxLimits(), *,
                   cache_dir: Optional[Path] = None) -> Sandbox:
  """The workspace at `boundary_stage` under root/workspace, with a fresh agent evidence log.

  Args:
    instance: the task.
    boundary_stage: S1..S5 (stages before it are done) or E2E (fresh, same as S1).
    root: an empty or missing folder; gets workspace/, evidence.jsonl and (when earlier stages
      ran here) handoff_evidence.jsonl, all outside the agent's view except workspace/.
    sandbox_limits: limits of the returned sandbox and of the expert's earlier calls.
    cache_dir: optional folder of boundary snapshots (`after_S<k>` per task): the deepest
      cached one is the starting point, and stages run here are cached for later calls.

  Returns:
    A Sandbox on root/workspace logging to root/evidence.jsonl (empty).
  """
  root = Path(root)
  if root.exists() and any(root.iterdir()):
    raise FileExistsError(f"materialize_at: root {str(root)!r} is not empty")
  root.mkdir(parents=True, exist_ok=True)
  workspace = root / WORKSPACE
  todo = stages_before(boundary_stage)
  start = None
  if cache_dir is not None:
    cached = [s for s in todo if _snapshot_path(cache_dir, instance, s).is_dir()]
    start = cached[-1] if cached else None
  if start is not None:
    shutil.copytree(_snapshot_path(cache_dir, instance, start), workspace, symlinks=True)
    todo = todo[todo.index(start) + 1:]
  else:
    materialize(dict(instance.files), workspace)
  if todo:
    handoff = Sandbox(workspace, sandbox_limits, evidence_path=root / HANDOFF_EVIDENCE)
    for stage in todo:
      run_expert(handoff, instance, (stage,))
      if cache_dir is not None:
        _save_snapshot(workspace, _snapshot_path(cache_dir, instance, stage))
  return Sandbox(workspace, sandbox_limits, evidence_path=root / EVIDENCE)


@dataclasses.dataclass(frozen=True)
class EpisodeResult:
  focus: str
  result: rubric.RubricResult
  calls: int


def expert_episode(instance: TaskInstance, focus: str, root: Path,
                   sandbox_limits: SandboxLimits = SandboxLimits(), *,
                   cache_dir: Optional[Path] = None,
                   skip: tuple[str, ...] = ()) -> EpisodeResult:
  """Materialises the row's boundary, runs the expert on the row's stages and scores it.

  `skip` drops those stages' actions (ablations); with a cache_dir and no skip, the workspace
  after each stage is cached as that boundary's snapshot.
  """
  sandbox = materialize_at(instance, focus, root, sandbox_limits, cache_dir=cache_dir)
  calls = 0
  for stage in stages_of(focus):
    calls += len(run_expert(sandbox, instance, (stage,), skip=skip))
    if cache_dir is not None and not skip and stage != workflow.STAGES[-1]:
      _save_snapshot(sandbox.workspace, _snapshot_path(cache_dir, instance, stage))
  scored = rubric.score(instance, focus, sandbox.workspace, sandbox.evidence)
  return EpisodeResult(focus=focus, result=scored, calls=calls)
