"""`evaluate`: one agent over the paired held-out cells -> the aggregate report."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from bat_jax import workflow
from bat_jax.evaluator import aggregation
from bat_jax.evaluator import cells as cells_lib
from bat_jax.evaluator import runner
from bat_jax.evaluator.agents import AgentFactory, builtin_factory
from bat_jax.rollout_protocol import RolloutLimits
from bat_jax.sandbox import SandboxLimits


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """What defines the measurement: the cells and the limits (both enter the digests). A run
  builds it from its config in `bat_jax.run_config.RunConfig.evaluation`.

  `secret` keys the cells' task seeds (`cells.make_cells`): fresh for each EvalSettings unless
  given; a run that evaluates baseline and candidate (and resumes) passes its stored one.
  """
  tier: str = "lite"
  seed: int = 20260816
  cells_per_track: int = 3
  tracks: tuple[str, ...] = workflow.TRACKS
  limits: RolloutLimits = RolloutLimits()
  sandbox_limits: SandboxLimits = SandboxLimits()
  action_space: str = "code"
  secret: str = dataclasses.field(default_factory=cells_lib.new_secret, repr=False)

  def cells(self) -> tuple[cells_lib.Cell, ...]:
    return cells_lib.make_cells(self.seed, self.cells_per_track, self.tier, self.tracks,
                                self.action_space, secret=self.secret)

  def heldback(self, cells_per_track: int) -> "EvalSettings":
    """The held-back split: the same secret, tier, tracks and limits under the next evaluator
    seed, so its cells share no task with these (checked: a shared cell raises)."""
    split = dataclasses.replace(self, seed=self.seed + 1, cells_per_track=cells_per_track)
    shared = {c.seed for c in self.cells()} & {c.seed for c in split.cells()}
    if shared:
      raise RuntimeError(f"held-back cells share {len(shared)} task(s) with the gate's cells")
    return split


def evaluate(agent: str | AgentFactory, records_dir: Path, *,
             settings: EvalSettings = EvalSettings(),
             options: runner.RunOptions = runner.RunOptions(),
             progress: Optional[runner.Progress] = None) -> dict[str, Any]:
  """Runs `agent` (a built-in name or a picklable factory) on every cell.

  Per-cell records go to `records_dir` (evaluator side); the return value is the aggregate
  report, already checked by the firewall.
  """
  factory = builtin_factory(agent) if isinstance(agent, str) else agent
  cells = settings.cells()
  records = runner.run_cells(cells, factory, records_dir, limits=settings.limits,
                             sandbox_limits=settings.sandbox_limits, options=options,
                             progress=progress)
  return aggregation.aggregate(
      records, tier=settings.tier, cell_set_digest=cells_lib.cell_set_digest(cells),
      protocol_digest=cells_lib.protocol_digest(cells, settings.limits, settings.sandbox_limits))


def stage_table(report: dict[str, Any]) -> str:
  """The report as a fixed-width table: one row per track plus the overall row."""
  def f(x: Optional[float]) -> str:
    return "  null" if x is None else f"{x:6.3f}"
  head = f"{'track':<15}" + "".join(f"{s:>7}" for s in workflow.STAGES) + \
      f"{'task':>7}{'agentic':>8}{'overall':>8}{'valid':>8}"
  rows = [head, "-" * len(head)]
  for track, t in report["track_scores"].items():
    rows.append(f"{track:<15}" + "".join(f" {f(t['stage_scores'][s])}" for s in workflow.STAGES)
                + f" {f(t['task'])}  {f(t['agentic'])}  {f(t['overall'])}"
                + f"{t['valid']:>5}/{t['cells']}")
  v = report["validity"]
  rows.append("-" * len(head))
  rows.append(f"{'ALL':<15}" + "".join(f" {f(report['stage_scores'][s])}" for s in workflow.STAGES)
              + f" {f(report['task_score'])}  {f(report['agentic'])}  {f(report['overall'])}"
              + f"{v['valid_cells']:>5}/{v['valid_cells'] + v['invalid_cells']}")
  return "\n".join(rows)
