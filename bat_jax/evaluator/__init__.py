"""The held-out teacher: its own tasks, paired cells, firewall, marker export, external adapter.

Nothing of its content may reach training: `tasks/` and `stagebank/` never import this package,
and the only export is the aggregate report (`firewall.check_report`) plus hashed markers.

Public API:
  evaluate(agent, records_dir, settings=EvalSettings(), options=RunOptions()) -> report
  EvalSettings(tier, seed, cells_per_track, tracks, limits, sandbox_limits, secret)
    (secret: the run's, keying the cells' seeds; `cells.load_or_create_secret(path)`)
  BUILTIN_AGENTS / builtin_factory(name); Agent, AgentFactory, Turn (the agent protocol)
  check_report / export_report / FirewallError; require_complete(report)
  markers_export.export_cells(cells, salt) -> hashed marker export
  ExternalEvaluator(argv, timeout_s).evaluate(checkpoint, request, work_dir) -> report
"""

from bat_jax.evaluator.agents import (BUILTIN_AGENTS, Agent, AgentFactory, Turn,
                                      builtin_factory)
from bat_jax.evaluator.aggregation import require_complete
from bat_jax.evaluator.cells import Cell, make_cells
from bat_jax.evaluator.evaluate import EvalSettings, evaluate, stage_table
from bat_jax.evaluator.external import ExternalEvaluator, ExternalEvaluatorError
from bat_jax.evaluator.firewall import FirewallError, check_report, export_report
from bat_jax.evaluator.runner import RunOptions

__all__ = ["BUILTIN_AGENTS", "Agent", "AgentFactory", "Cell", "EvalSettings",
           "ExternalEvaluator", "ExternalEvaluatorError", "FirewallError", "RunOptions", "Turn",
           "builtin_factory", "check_report", "evaluate", "export_report", "make_cells",
           "require_complete", "stage_table"]
