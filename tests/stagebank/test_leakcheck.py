"""The fail-closed leakage pre-check: planted leaks of every kind, clean rounds, receipts."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from bat_jax.stagebank import build
from bat_jax.stagebank import leakcheck
from bat_jax.stagebank import rounds

REFERENCE_DIR = Path(__file__).parent / "fixtures"  # copies of the reference rows
SMALL = rounds.RoundSpec(1, rounds.RoundWeights.for_target("S2"), seed=3, n_batches=6)


@pytest.fixture(scope="module")
def clean_row():
  return {"prompt": [{"role": "system", "content": "Work in the sandbox."},
                     {"role": "user", "content": "Run python3 pipeline/infer.py 2>/dev/null, "
                                                 "then write /workspace/outputs (and/or 1/2)."}],
          "extra_info": {"state_id": "abc", "rollout_transcript_reuse_allowed": False,
                         "notes": ["see http://example.org/a/b"],
                         "code": "x = total / n\nprint(a/b)\ncat models/*/card.json ${d}/x"}}


def _plant(row, path, value):
  """Sets row[path...] = value, creating nested dicts."""
  row = copy.deepcopy(row)
  node = row
  for key in path[:-1]:
    node = node.setdefault(key, {})
  node[path[-1]] = value
  return row


def test_clean_row_has_no_findings(checker, clean_row):
  assert checker.check_row(clean_row) == []


@pytest.mark.parametrize("key", [
    "held_out_answer", "heldOutAnswer", "Held-Out Answers", "expected_answer", "ExpectedAnswer",
    "expected answer", "evaluation_report", "EVALUATION-REPORT", "evaluator_trace",
    "evaluatorTraces", "rollout_transcript", "RolloutTranscript", "teacher_completion",
    "teacher-completions", "workspace_path", "workspacePath", "correction_text",
    "Correction Text"])
def test_forbidden_field_names_in_every_spelling(checker, clean_row, key):
  row = _plant(clean_row, ["extra_info", "provenance", "nested", key], "x")
  findings = checker.check_row(row)
  assert [f.reason for f in findings] == ["forbidden_field"]
  assert findings[0].path.endswith(key)


@pytest.mark.parametrize("text", [
    "/home/alice/bank/row.json", "output at /tmp/pytest-1/ws", "cwd='/srv/checkout'",
    "stdout:/root/x", "see ~/data/cases", r"C:\Users\bob\case.pgm", "path=/var/lib/x",
    "/workspacefake/x"])
def test_absolute_host_paths(checker, clean_row, text):
  findings = checker.check_row(_plant(clean_row, ["extra_info", "deep", "list"], [1, {"t": text}]))
  assert {f.reason for f in findings} == {"absolute_path"}


def test_absolute_path_in_a_key(checker, clean_row):
  findings = checker.check_row(_plant(clean_row, ["extra_info", "/home/u/file"], 1))
  assert [f.reason for f in findings] == ["absolute_path"]


@pytest.mark.parametrize("where,text", [
    (["extra_info", "note"], "HELDOUT-CASE-0042"),
    (["extra_info", "a", "b", "c"], "the file heldout_case_0042.pgm was opened"),
    (["extra_info", "list"], ["ok", {"deeper": "Answer 7.125 mL observed"}]),
    (["extra_info", "Heldout Case 0042"], "key itself"),
])
def test_heldout_markers_nested_cased_embedded(checker, clean_row, where, text):
  findings = checker.check_row(_plant(clean_row, where, text))
  assert {f.reason for f in findings} == {"heldout_marker"}
  assert all("0042" not in f.detail and "7.125" not in f.detail for f in findings)


@pytest.mark.parametrize("key,value", [
    ("rollout_transcript_reuse_allowed", True), ("reuseAllowed", "true"), ("reuse", 1),
    ("allow_reuse", "YES"), ("reuse_flag", {"on": True})])
def test_true_reuse_flags(checker, clean_row, key, value):
  findings = checker.check_row(_plant(clean_row, ["extra_info", "flags", key], value))
  assert [f.reason for f in findings] == ["reuse_flag"]


@pytest.mark.parametrize("value", [False, 0, None, "false", "No", ""])
def test_false_reuse_flags_pass(checker, clean_row, value):
  assert checker.check_row(_plant(clean_row, ["extra_info", "reuse_allowed"], value)) == []


def test_reference_rows_pass(checker):
  for name in ("grpo-prompt-row.json", "sft-semantic-row.json"):
    row = json.loads((REFERENCE_DIR / name).read_text())
    assert checker.check_row(row) == [], name


def test_clean_round_passes_with_no_false_rejections(checker, source):
  built = build.build_round(SMALL, source, checker)
  receipt = built.receipt.to_json()
  assert receipt["passed"] and receipt["rows_checked"] == 48 and receipt["rows_rejected"] == 0
  assert set(receipt["rejections_by_reason"].values()) == {0}
  assert receipt["marker_export_digest"] == checker.matcher.digest
  assert receipt["marker_count"] == 2


class _LeakySource:
  """Wraps a source and plants one leak in one brief (so exactly one row is bad)."""
  name = "leaky"

  def __init__(self, inner, seed, leak):
    self.inner, self.seed, self.leak = inner, seed, leak

  def describe(self, track, outcome, seed, focus):
    task = self.inner.describe(track, outcome, seed, focus)
    if seed == self.seed:
      return type(task)(task.generator, task.task_id, task.brief + " " + self.leak,
                        task.workspace_sha256)
    return task


@pytest.mark.parametrize("leak,reason", [
    ("Compare with Heldout_Case_0042.", "heldout_marker"),
    ("Files are in /home/trainer/ws.", "absolute_path")])
def test_one_bad_row_rejects_the_whole_round(checker, source, leak, reason):
  victim = rounds.plan_round(SMALL)["s_mix"][3].task_seed
  with pytest.raises(leakcheck.RoundRejected, match=reason) as err:
    build.build_round(SMALL, _LeakySource(source, victim, leak), checker)
  receipt = err.value.receipt
  assert not receipt.passed and receipt.rows_checked == 48 and receipt.rows_rejected == 1
  assert receipt.rejections_by_reason[reason] == 1
  assert receipt.samples[0].pool == "s_mix"


def test_named_marker_export_must_exist(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.json.*fails closed"):
    build.load_matcher(tmp_path / "nope.json")
  assert build.load_matcher(tmp_path / "nope.json", allow_no_markers=True).marker_count == 0
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(ValueError, match="bad.json"):
    build.load_matcher(tmp_path / "bad.json")


def test_no_marker_export_fails_closed_unless_allowed(tmp_path, source):
  """Without an export nothing is published; the development flag is recorded in the receipt."""
  bank = tmp_path / "bank"
  with pytest.raises(FileNotFoundError, match="markers.json.*--allow-no-markers"):
    build.build_and_publish(bank, SMALL, source)
  assert not bank.exists() or not any(bank.iterdir())
  empty = build.load_matcher(None, allow_no_markers=True)
  with pytest.raises(ValueError, match="no markers.*fails closed"):
    leakcheck.LeakChecker(empty)
  out = build.build_and_publish(bank, SMALL, source, allow_no_markers=True)
  receipt = json.loads((out / "manifest.json").read_text())["leak_receipt"]
  assert receipt["allow_no_markers"] is True and receipt["marker_count"] == 0


def test_a_round_rejected_for_a_chance_row_is_built_again(tmp_path, source):
  """One row that spells a held-out marker rejects its round whole (above); the bank then builds
  the round again from other tasks (`attempt` 1) and records the rejected attempt's receipt."""
  leak = "Compare with Heldout_Case_0042."
  bank = tmp_path / "bank"
  bank.mkdir()
  (bank / build.MARKERS_FILE).write_text(json.dumps(
      build.markers.export_markers(["heldout_case_0042"], salt="s")))
  victim = rounds.plan_round(SMALL)["s_mix"][3].task_seed
  out = build.build_and_publish(bank, SMALL, _LeakySource(source, victim, leak))
  manifest = json.loads((out / "manifest.json").read_text())
  assert manifest["config"]["attempt"] == 1
  assert [r["rows_rejected"] for r in manifest["rejected_attempts"]] == [1]
  assert manifest["leak_receipt"]["passed"] and manifest["leak_receipt"]["rows_checked"] == 48
  again = rounds.plan_round(dataclasses.replace(SMALL, attempt=1))
  seeds = {s.task_seed for pool in again.values() for s in pool}
  assert victim not in seeds and len(seeds) == 48
  assert {s.state_id for pool in again.values() for s in pool}.isdisjoint(
      s.state_id for pool in rounds.plan_round(SMALL).values() for s in pool)
  # Attempt 0 is the round it always was: manifests of rounds built before do not change.
  assert "attempt" not in SMALL.to_json()


def test_a_round_with_many_leaking_rows_is_not_built_again(tmp_path, source):
  bank = tmp_path / "bank"
  bank.mkdir()
  (bank / build.MARKERS_FILE).write_text(json.dumps(
      build.markers.export_markers(["task/spec.json"], salt="s")))   # in every row
  with pytest.raises(leakcheck.RoundRejected, match="heldout_marker"):
    build.build_and_publish(bank, SMALL, source)
  assert not any(p.name.startswith("round_") for p in bank.iterdir())
