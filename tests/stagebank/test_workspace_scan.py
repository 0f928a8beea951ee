"""The leak pre-check's workspace scan: what text it reads, and identical workspaces once."""

import dataclasses
import json

import pytest

from bat_jax import markers
from bat_jax.stagebank import build, leakcheck, rounds, task_source

_RASTER = "P2\n# acquired ho-823311 night shift\n4 2\n255\n260 216 236 258\n222 231 255 211\n"


def _checker(*strings):
  return leakcheck.LeakChecker(markers.MarkerMatcher(markers.export_markers(strings, salt="t")))


def test_raster_comments_are_text_and_pixel_rows_are_not():
  pixels = _checker("236 258 222")
  assert pixels.check_workspace({"data/a.pgm": _RASTER.encode()}) == []
  assert _checker("ho-823311").check_workspace({"data/a.pgm": _RASTER.encode()}) != []
  # The same numbers in a table are text: found there.
  found = pixels.check_workspace({"data/t.csv": b"x,y,z\n236 258 222,1,2\n"})
  assert {f.path for f in found} == {"workspace:data/t.csv"}
  # A file that is no raster from its first line on is scanned whole.
  assert pixels.check_workspace({"notes.txt": "x\nP2\n236 258 222\n"}) != []


def test_marker_hidden_in_raster_text_lines_is_caught():
  checker = _checker("secret-heldout-case-7781")
  hidden = _RASTER + "secret heldout case 7781\n"
  assert checker.check_workspace({"a.pgm": hidden}) != []
  assert checker.check_workspace({"a.pgm": _RASTER.replace("4 2", "4 2 secret-heldout-case-7781")})


def _row(track, seed, stage, digest):
  return {"extra_info": {
      "workspace_recipe": {"generator": f"bat_jax.train_tasks/{track}", "track": track,
                           "seed": seed, "outcome": "success", "action_space": "code",
                           "boundary_stage": stage},
      "provenance": {"source_digest": digest}}}


def test_identical_workspaces_are_scanned_once(monkeypatch):
  calls = []
  finding = leakcheck.LeakFinding(0, "", "heldout_marker", "workspace:x", "sha256:0")

  def fake(checker, row, index, pool):
    calls.append(row["extra_info"]["workspace_recipe"]["seed"])
    return [finding] if row["extra_info"]["workspace_recipe"]["seed"] == 1 else []
  monkeypatch.setattr(build, "workspace_findings", fake)
  pools = {"a": [_row("vqa", 1, "S1", "d1"), _row("vqa", 2, "S1", "d2")],
           "b": [_row("vqa", 1, "S3", "d1"), _row("vqa", 1, "S2", "d1")]}
  found = build.scan_workspaces(None, pools)
  assert sorted(calls) == [1, 2]  # seed 1's workspace (three rows) scanned once
  assert [(f.row, f.pool) for f in found] == [(0, "a"), (2, "b"), (3, "b")]
  assert found[0] == dataclasses.replace(finding, row=0, pool="a")


def test_build_reports_workspace_markers_at_their_rows_with_worker_processes():
  """The scan rides along task generation, also in worker processes: findings name the rows
  whose workspaces hold the marker, and only those."""
  spec = rounds.RoundSpec(0, rounds.RoundWeights.for_target("S1"), seed=4, n_batches=1)
  source = task_source.TasksPackageSource()
  built = build.build_round(spec, source, _checker("unrelated-heldout-9931"), workers=2)
  rows = [row for pool in built.pools.values() for row in pool]
  row_text = json.dumps(built.pools).lower()
  texts = [" ".join(c.decode("utf-8", "ignore") if isinstance(c, bytes) else c
                    for c in task_source.instance_for(row).files.values()) for row in rows]
  # A line of row 3's workspace that some other row's workspace lacks, so "only those" bites.
  hidden = next(line.strip() for line in texts[3].splitlines()
                if len(line.strip()) > 12 and "," in line and line.strip().lower() not in row_text
                and not all(line.strip() in text for text in texts))
  with pytest.raises(leakcheck.RoundRejected, match="workspace:") as err:
    build.build_round(spec, source, _checker(hidden), workers=2)
  receipt = err.value.receipt
  holding = sorted(i for i, text in enumerate(texts) if hidden in text)
  flagged = sorted({f.row for f in receipt.samples})
  # Every row whose workspace holds the marker is rejected, and no other; the receipt's samples
  # (capped findings, in row order) name the first of them.
  assert 3 in holding and receipt.rows_rejected == len(holding)
  assert flagged and flagged == holding[:len(flagged)]
