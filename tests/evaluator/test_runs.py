"""End-to-end cells in the real sandbox: oracle ceiling, null floor, skip-stage separation,
invalid cells for infrastructure failures, and the CLI."""

import dataclasses
import json

import pytest

from bat_jax import gate, workflow
from bat_jax.evaluator import __main__ as cli
from bat_jax.evaluator import aggregation
from bat_jax.evaluator.agents import Turn, builtin_factory
from bat_jax.evaluator.cells import Cell
from bat_jax.evaluator.evaluate import EvalSettings, evaluate
from bat_jax.evaluator.firewall import check_report
from bat_jax.evaluator.runner import RunOptions, run_cells

import eval_agents

pytestmark = pytest.mark.usefixtures("require_bwrap")
DIGESTS = {"protocol_digest": "c" * 64, "cell_set_digest": "d" * 64}


def _rotating_cells(seed=4):
  """One cell per track; outcomes rotate over tracks and tiers alternate (each of the three
  outcomes and both tiers is covered; the slow test runs the full grid)."""
  return [Cell(t, workflow.OUTCOMES[i % 3], seed + i, ("lite", "standard")[i % 2])
          for i, t in enumerate(workflow.TRACKS)]


def _run(tmp_path, agent, cells, workers=0, **options):
  factory = builtin_factory(agent) if isinstance(agent, str) else agent
  records = run_cells(cells, factory, tmp_path / "records",
                      options=RunOptions(workers=workers, **options))
  tier = cells[0].tier
  return records, aggregation.aggregate(records, tier=tier, **DIGESTS)


def test_oracle_scores_at_least_095_on_every_track(tmp_path):
  records, report = _run(tmp_path, "oracle", _rotating_cells(), workers=2)
  assert report["validity"] == {"valid": True, "valid_cells": 7, "invalid_cells": 0}
  for track, scores in report["track_scores"].items():
    assert scores["overall"] >= 0.95, (track, scores)
  assert report["overall"] >= 0.95 and report["failure_categories"] == {}
  assert all(r["finish_reason"] == "agent_stop" and r["tool_calls"] <= 23 for r in records)
  # Per-cell records stay evaluator-side; nothing of them is in the report.
  assert len(list((tmp_path / "records" / "cells").glob("*.json"))) == 7
  assert not any(r["task_id"] in json.dumps(report) for r in records)


def test_null_agent_scores_zero_agentic(tmp_path):
  records, report = _run(tmp_path, "null", _rotating_cells())
  assert report["validity"]["valid"] and report["agentic"] == 0.0 and report["overall"] == 0.0
  assert all(t["agentic"] == 0.0 for t in report["track_scores"].values())
  assert report["failure_categories"]["no_submission"] == 7
  assert report["completion"]["stage_evidence"] == {s: 0 for s in workflow.STAGES}


@pytest.mark.parametrize("stage", workflow.STAGES)
def test_skip_stage_agent_loses_mainly_its_own_stage(tmp_path, stage):
  cells = [Cell("classification", "recovery", 9, "lite")]
  _, report = _run(tmp_path, f"skip-{stage}", cells)
  scores = report["stage_scores"]
  assert scores[stage] <= 0.4, scores
  assert all(scores[s] >= 0.95 for s in workflow.STAGES if s != stage), scores


class _Spammer:
  """Calls the tool every turn with a long output; records what it was shown."""

  def __init__(self, malformed=False):
    self.malformed = malformed
    self.observations = []

  def __call__(self, messages):
    if messages[-1]["role"] == "tool":
      self.observations.append(messages[-1]["content"])
    if self.malformed:
      return Turn((), error="no tool call found")
    return Turn(({"name": "execute_code",
                  "arguments": {"language": "python", "code": "print('x' * 5000)"}},))


@pytest.mark.parametrize("malformed", [False, True])
def test_training_limits_apply(tmp_path, malformed):
  agent = _Spammer(malformed)
  records, _ = _run(tmp_path, lambda instance: agent, [Cell("vqa", "success", 2, "lite")])
  rec = records[0]
  assert rec["valid"] and rec["turns"] == 24
  if malformed:
    assert rec["finish_reason"] == "max_turns" and rec["tool_calls"] == 0
    assert rec["malformed_turns"] == 24 and agent.observations[0] == "error: no tool call found"
  else:
    assert rec["finish_reason"] == "max_tool_calls" and rec["tool_calls"] == 23
    assert len(agent.observations) == 23
    assert all(len(o) <= workflow.MAX_OBSERVATION_CHARS for o in agent.observations)
    assert "truncated" in agent.observations[0]


def test_unpicklable_factory_is_refused_for_workers(tmp_path):
  with pytest.raises(TypeError, match="cannot be sent to worker processes"):
    _run(tmp_path, lambda instance: None, [Cell("vqa", "success", 2, "lite")], workers=1)


def test_infrastructure_failures_make_cells_invalid_not_zero(tmp_path):
  tracks = ("classification", "vqa", "report", "detection", "segmentation", "synthesis")
  cells = [Cell(t, "success", 1, "lite") for t in tracks]
  records, report = _run(tmp_path, eval_agents.MisbehavingAgent, cells, workers=2,
                         cell_timeout_s=6.0)
  by_track = {r["cell"]["track"]: r for r in records}
  assert by_track["classification"]["invalid_reason"] == "crash"   # worker died
  assert by_track["vqa"]["invalid_reason"] == "timeout"
  assert by_track["report"]["invalid_reason"] == "parser_failure"
  assert by_track["detection"]["invalid_reason"] == "crash"        # agent raised
  assert "engine connection reset" in by_track["detection"]["detail"]
  assert by_track["segmentation"]["valid"] and by_track["segmentation"]["malformed_turns"] == 1
  assert by_track["synthesis"]["valid"]
  assert report["validity"] == {"valid": False, "valid_cells": 2, "invalid_cells": 4}
  cats = report["failure_categories"]
  assert (cats["crash"], cats["timeout"], cats["parser_failure"]) == (2, 1, 1)
  # Invalid cells are not scored as zero: their tracks have no score at all.
  assert report["track_scores"]["vqa"]["overall"] is None
  assert report["track_scores"]["segmentation"]["overall"] == 0.0
  check_report(report)
  with pytest.raises(ValueError, match="4 invalid cell"):
    aggregation.require_complete(report)


def test_cli_writes_only_the_aggregate(tmp_path, capsys):
  out = tmp_path / "export"
  code = cli.main(["--agent=null", "--tier=standard", f"--out={out}", "--tracks=vqa,report",
                   "--cells-per-track=2", "--workers=0", f"--markers={tmp_path / 'm.json'}"])
  assert code == 0
  assert sorted(p.name for p in out.iterdir()) == ["report.json"]
  report = json.loads((out / "report.json").read_text())
  check_report(report)
  assert set(report["track_scores"]) == {"vqa", "report"} and report["tier"] == "standard"
  assert len(list((tmp_path / "export.records" / "cells").glob("*.json"))) == 4
  captured = capsys.readouterr()
  assert "[  4/4]" in captured.err and "ALL" in captured.out and "S3" in captured.out
  assert json.loads((tmp_path / "m.json").read_text())["marker_count"] > 50


def test_baseline_and_candidate_see_the_same_cells(tmp_path):
  settings = EvalSettings(tracks=("vqa", "report"), cells_per_track=1)
  a = evaluate("null", tmp_path / "a", settings=settings, options=RunOptions(workers=0))
  b = evaluate("skip-S1", tmp_path / "b", settings=settings, options=RunOptions(workers=0))
  assert a["cell_set_digest"] == b["cell_set_digest"]
  assert a["protocol_digest"] == b["protocol_digest"]
  assert sorted(p.name for p in (tmp_path / "a" / "cells").iterdir()) == \
      sorted(p.name for p in (tmp_path / "b" / "cells").iterdir())
  # The promotion gate accepts the pair (and would refuse unpaired reports).
  decision = gate.check(a, b, gate.GateThresholds(), training_healthy=True)
  assert decision is not None
  other = evaluate("null", tmp_path / "c", settings=dataclasses.replace(settings, seed=99),
                   options=RunOptions(workers=0))
  with pytest.raises(gate.UnpairedReportsError):
    gate.check(a, other, gate.GateThresholds(), training_healthy=True)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["lite", "standard"])
def test_full_grid_oracle_and_skip_agents(tmp_path, tier):
  settings = EvalSettings(tier=tier, cells_per_track=3, seed=123)
  oracle = evaluate("oracle", tmp_path / "oracle", settings=settings,
                    options=RunOptions(workers=2))
  assert oracle["validity"]["valid"]
  assert all(t["overall"] >= 0.95 for t in oracle["track_scores"].values()), oracle
  for stage in workflow.STAGES:
    skip = evaluate(f"skip-{stage}", tmp_path / stage, settings=settings,
                    options=RunOptions(workers=2))
    drops = {s: oracle["stage_scores"][s] - skip["stage_scores"][s] for s in workflow.STAGES}
    assert max(drops, key=drops.get) == stage and drops[stage] >= 0.5, (stage, drops)
    assert all(d <= 0.1 for s, d in drops.items() if s != stage), (stage, drops)


def test_markers_only_writes_the_export_the_stage_bank_reads(tmp_path, capsys):
  from bat_jax.stagebank import build
  path = tmp_path / "markers.json"
  assert cli.main(["--markers-only", f"--markers={path}", "--cells-per-track=1",
                   "--tracks=vqa"]) == 0
  assert str(path) in capsys.readouterr().out
  matcher = build.load_matcher(path)  # what `python -m bat_jax.stagebank sft --markers=` loads
  assert json.loads(path.read_text())["marker_count"] > 10 and matcher is not None
  with pytest.raises(SystemExit, match="--markers-only needs --markers"):
    cli.main(["--markers-only"])
  with pytest.raises(SystemExit, match="--out is required"):
    cli.main(["--agent=null"])
