"""The firewall admits the aggregate report only (import boundaries: test_boundaries.py)."""

import copy

import pytest

from bat_jax.evaluator.firewall import FirewallError, check_report, export_report


def test_a_well_formed_report_passes(good_report, tmp_path):
  check_report(good_report)
  path = export_report(good_report, tmp_path / "out" / "report.json")
  assert path.read_text().startswith("{")


def _put(report, path, value):
  *head, last = path
  node = report
  for k in head:
    node = node[k]
  node[last] = value


FORBIDDEN = [
    (("task_ids",), ["ho-1234abcd"], r"\$\.task_ids: is not an allowed field"),
    (("transcript",), "assistant: ...", r"\$\.transcript"),
    (("track_scores", "vqa", "answers"), {"q1": "left"}, r"\$\.track_scores\.vqa\.answers"),
    (("track_scores", "ho-deadbeef"), {}, r"\$\.track_scores\.ho-deadbeef: is not an allowed key"),
    (("failure_categories", "diagnosis: missing radonpp4"), 1, r"failure_categories\.diagnosis"),
    (("stage_scores", "S3"), "0.9 (case hx-017 failed)", r"\$\.stage_scores\.S3: must be a score"),
    (("stage_scores", "S6"), 0.1, r"\$\.stage_scores\.S6"),
    (("completion", "cells"), 2.5, r"\$\.completion\.cells: must be a count"),
    (("protocol_digest",), "data/corpus_7/roster.csv", r"\$\.protocol_digest: must be a 64"),
    (("tier",), "lite; paths=/tmp/x", r"\$\.tier: must be one of"),
    (("validity", "trace"), ["worker died"], r"\$\.validity\.trace"),
    (("overall",), 1.5, r"\$\.overall: must be a score"),
    (("task_score",), True, r"\$\.task_score: must be a score"),
]


@pytest.mark.parametrize("path,value,message", FORBIDDEN)
def test_forbidden_fields_and_values_are_rejected_by_name(good_report, tmp_path, path, value,
                                                          message):
  bad = copy.deepcopy(good_report)
  _put(bad, path, value)
  with pytest.raises(FirewallError, match=message):
    check_report(bad)
  with pytest.raises(FirewallError):
    export_report(bad, tmp_path / "report.json")
  assert not (tmp_path / "report.json").exists()


def test_a_missing_field_is_named(good_report):
  del good_report["cell_set_digest"]
  with pytest.raises(FirewallError, match=r"\$\.cell_set_digest: is missing"):
    check_report(good_report)


def test_nulls_are_allowed_scores(good_report):
  good_report["stage_scores"]["S4"] = None
  good_report["track_scores"]["vqa"]["overall"] = None
  check_report(good_report)
