"""Stage rubrics: only executed work earns credit; nulls are not zeros; skipping costs."""

import json
import os
import shutil

import pytest

from bat_jax import rubric, workflow
from bat_jax.sandbox import Sandbox, SandboxLimits, fingerprint, materialize
from bat_jax.train_tasks import FAMILIES, expert_episode, materialize_at, run_expert

from hacks import score_bounded

A = workflow.ARTIFACTS
LIMITS = SandboxLimits(wall_s=60.0)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A recovery task solved end to end by the expert (workspace + evidence)."""
  if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
  inst = FAMILIES["segmentation"].generate(11, "recovery")
  root = tmp_path_factory.mktemp("finished")
  sandbox = materialize_at(inst, workflow.E2E, root / "row", LIMITS)
  run_expert(sandbox, inst, workflow.STAGES)
  return inst, sandbox


def _copy_files(sandbox):
  return {rel: (sandbox.workspace / rel).read_bytes() for rel in fingerprint(sandbox.workspace)}


def test_expert_run_is_full_marks(finished):
  inst, sandbox = finished
  res = rubric.score(inst, workflow.E2E, sandbox.workspace, sandbox.evidence)
  assert all(v is True for items in res.stage_items.values() for v in items.values())
  assert res.reward == pytest.approx(1.0) and res.task_score == pytest.approx(1.0)


@pytest.mark.parametrize("track,outcome", [(t, o) for t in workflow.TRACKS
                                           for o in workflow.OUTCOMES])
def test_do_nothing_scores_zero(tmp_path, track, outcome):
  inst = FAMILIES[track].generate(5, outcome)
  materialize(dict(inst.files), tmp_path)
  for focus in workflow.FOCI:
    res = rubric.score(inst, focus, tmp_path, [])
    assert res.reward == 0.0
    assert all(v is None for v in res.stage_scores.values())  # null, not zero
    assert res.task_score is None


def test_handoff_artifacts_earn_nothing_for_the_agent(require_bwrap, tmp_path):
  inst = FAMILIES["detection"].generate(2, "success")
  sandbox = materialize_at(inst, "S5", tmp_path / "row", LIMITS)
  for focus in workflow.FOCI:
    assert rubric.score(inst, focus, sandbox.workspace, sandbox.evidence).reward == 0.0


def test_prose_only_artifacts_earn_nothing(finished, tmp_path):
  """The expert's final files written directly (no executed call): S1-S5 earn nothing."""
  inst, done = finished
  materialize(_copy_files(done), tmp_path / "ws")
  res = rubric.score(inst, workflow.E2E, tmp_path / "ws", [])
  assert res.reward == 0.0 and all(v is None for v in res.stage_scores.values())
  # Executed calls that merely touch each stage's folder make the stages scorable: all zero.
  sandbox = Sandbox(tmp_path / "ws", LIMITS, evidence_path=tmp_path / "ev.jsonl")
  touch = " && ".join(f"echo x > {d[0]}/notes_by_agent.txt" for d in workflow.STAGE_DIRS.values())
  assert sandbox.execute("bash", touch).exit_code == 0
  res = rubric.score(inst, workflow.E2E, sandbox.workspace, sandbox.evidence)
  assert res.stage_scores == {s: 0.0 for s in workflow.STAGES}, res.stage_items
  assert res.task_score == 0.0 and res.reward == 0.0


def test_failed_calls_and_symlinks_earn_nothing(finished, tmp_path):
  inst, done = finished
  plan = (done.workspace / A["plan"]).read_text()
  materialize(dict(inst.files), tmp_path / "ws")
  sandbox = Sandbox(tmp_path / "ws", LIMITS)
  (tmp_path / "plan.md").write_text(plan)
  code = "import os\nos.makedirs('plan', exist_ok=True)\nopen('plan/plan.md', 'w').write(%r)\n"
  assert sandbox.execute("python", code % plan + "raise SystemExit(3)").exit_code == 3
  assert rubric.score(inst, "S1", sandbox.workspace, sandbox.evidence).stage_scores["S1"] is None
  link = "rm plan/plan.md && ln -s /etc/hostname plan/plan.md"
  assert sandbox.execute("bash", link).exit_code == 0
  res = rubric.score(inst, "S1", sandbox.workspace, sandbox.evidence)
  assert res.stage_items["S1"]["plan_written"] is False and res.reward == 0.0
  assert sandbox.execute("bash", "rm plan/plan.md").exit_code == 0
  assert sandbox.execute("python", code % plan).exit_code == 0  # the same plan, executed
  assert rubric.score(inst, "S1", sandbox.workspace, sandbox.evidence).reward == 1.0


def test_tampered_files_and_forged_receipts_fail(finished, tmp_path):
  inst, done = finished
  shutil.copytree(done.workspace, tmp_path / "ws")
  ev = done.evidence
  # Edited on the host after the receipt: no longer produced, receipt no longer matches.
  with open(tmp_path / "ws" / A["predictions"], "a") as f:
    f.write('{"case_id": "extra", "prediction": []}\n')
  items = rubric.score(inst, "S4", tmp_path / "ws", ev).stage_items["S4"]
  assert items == {"all_cases_inferred": False, "outputs_persisted": False,
                   "coverage_checked": False}
  # A receipt written by an executed call but with a wrong digest is rejected.
  sandbox = Sandbox(tmp_path / "ws", LIMITS)
  forged = {"stage": "S3", "files": {A["validation_output"]: "0" * 64},
            "checks": {"shape_ok": True, "non_degenerate": True}}
  code = f"import json\njson.dump({forged!r}, open({A['validation_receipt']!r}, 'w'))"
  assert sandbox.execute("python", code).exit_code == 0
  items = rubric.score(inst, "S3", sandbox.workspace, sandbox.evidence).stage_items["S3"]
  assert not items["output_shape_checked"] and not items["non_degeneracy_checked"]


def test_wrong_diagnosis_earns_no_recovery_credit(require_bwrap, tmp_path):
  inst = FAMILIES["classification"].generate(4, "recovery")
  sandbox = materialize_at(inst, "S3", tmp_path / "row", LIMITS)
  wrong = {"fault": "missing_dependency", "subject": "numpy"}
  code = (f"import json, os\nos.makedirs('validation', exist_ok=True)\n"
          f"json.dump({wrong!r}, open('validation/diagnosis.json', 'w'))")
  assert sandbox.execute("python", code).exit_code == 0
  items = rubric.score(inst, "S3", sandbox.workspace, sandbox.evidence).stage_items["S3"]
  assert not items["failure_diagnosed"] and not items["correction_executed"]
  assert not items["corrected_result_verified"]


def test_fabricating_results_under_failure_is_penalised(require_bwrap, tmp_path):
  inst = FAMILIES["classification"].generate(6, "failure")
  sandbox = materialize_at(inst, "S4", tmp_path / "row", LIMITS)
  label = inst.spec["prediction_schema"]["labels"][0]
  lines = "".join(json.dumps({"case_id": c, "prediction": label}) + "\n"
                  for c in inst.hidden["case_ids"])
  code = f"open({A['predictions']!r}, 'w').write({lines!r})"
  assert sandbox.execute("python", "import os; os.makedirs('outputs', exist_ok=True)\n" + code
                         ).exit_code == 0
  run_expert(sandbox, inst, ("S4", "S5"))
  res = rubric.score(inst, "S4", sandbox.workspace, sandbox.evidence)
  assert res.stage_items["S4"] == {"blocker_recorded": True, "no_fabricated_predictions": False}
  sub = inst.spec["submission"]
  code = (f"import os\nos.makedirs('submission', exist_ok=True)\n"
          f"open({sub['path']!r}, 'w').write('made,up\\n')")
  assert sandbox.execute("python", code).exit_code == 0
  items = rubric.score(inst, "S5", sandbox.workspace, sandbox.evidence).stage_items["S5"]
  assert items["failure_report_honest"] and not items["no_fabricated_results"]
  assert not items["handed_off"]  # the receipt does not name the fabricated file


@pytest.mark.parametrize("dropped", workflow.STAGES)
def test_dropping_a_stage_costs_mainly_that_stage(require_bwrap, tmp_path, dropped):
  inst = FAMILIES["vqa"].generate(9, "recovery")
  ep = expert_episode(inst, workflow.E2E, tmp_path / "row", LIMITS, skip=(dropped,))
  scores = ep.result.stage_scores
  assert scores[dropped] is None
  k = workflow.STAGES.index(dropped)
  assert all(scores[s] == 1.0 for s in workflow.STAGES[:k])
  if dropped in ("S1", "S5"):  # nothing downstream depends on the plan or the hand-off
    assert all(scores[s] == 1.0 for s in workflow.STAGES if s != dropped)
  assert ep.result.reward <= 1.0 - 0.5 * workflow.STAGE_WEIGHTS[dropped] + 1e-9
  lost = {s: 1.0 - (scores[s] or 0.0) for s in workflow.STAGES}
  assert max(lost, key=lambda s: (lost[s], s == dropped)) == dropped


def test_unknown_focus_is_named(tmp_path):
  inst = FAMILIES["vqa"].generate(0, "success")
  with pytest.raises(ValueError, match="S6"):
    rubric.score(inst, "S6", tmp_path, [])


# -- adversarial: links, special files and receipts that lie ------------------------------------

def _clone(finished, tmp_path):
  """A copy of the expert's finished workspace with its evidence log, for one more agent call."""
  inst, done = finished
  shutil.copytree(done.workspace, tmp_path / "ws")
  shutil.copy(done.evidence_path, tmp_path / "ev.jsonl")
  return inst, Sandbox(tmp_path / "ws", LIMITS, evidence_path=tmp_path / "ev.jsonl")


_RECEIPT_FOR_LINKS = """
import hashlib, json, os
files = {}
for d, dirs, names in os.walk('submission'):
  for n in dirs + names:
    p = os.path.join(d, n)
    if os.path.islink(p):
      files[p] = hashlib.sha256(b'symlink\\0' + os.fsencode(os.readlink(p))).hexdigest()
    elif os.path.isfile(p) and n != 'receipt.json':
      files[p] = hashlib.sha256(open(p, 'rb').read()).hexdigest()
json.dump({'stage': 'S5', 'files': files, 'checks': {'schema_ok': True, 'missing': []}},
          open('submission/receipt.json', 'w'))
"""

_LINK_ATTACKS = {
    # the whole submission folder -> a host folder holding the right answers
    "abs_dir_link": "import os, shutil\nshutil.rmtree('submission/labels')\n"
                    "os.symlink('{host}', 'submission/labels')\n",
    # each file -> its host copy, relative and dangling inside the sandbox
    "relative_file_links": "import os\nfor n in os.listdir('submission/labels'):\n"
                           "  os.remove('submission/labels/' + n)\n"
                           "  os.symlink('{rel}/' + n, 'submission/labels/' + n)\n",
    "dev_zero": "import os\nn = sorted(os.listdir('submission/labels'))[0]\n"
                "os.remove('submission/labels/' + n)\nos.symlink('/dev/zero', 'submission/labels/' + n)\n",
    "fifo": "import os\nn = sorted(os.listdir('submission/labels'))[0]\n"
            "os.remove('submission/labels/' + n)\nos.mkfifo('submission/labels/' + n)\n",
}


@pytest.mark.parametrize("attack", sorted(_LINK_ATTACKS))
def test_planted_links_and_special_files_score_nothing(finished, tmp_path, attack):
  inst, sandbox = _clone(finished, tmp_path)
  host = tmp_path / "host_answers"
  shutil.copytree(sandbox.workspace / "submission" / "labels", host)
  rel = os.path.relpath(host, sandbox.workspace / "submission" / "labels")
  code = _LINK_ATTACKS[attack].format(host=host, rel=rel) + _RECEIPT_FOR_LINKS
  assert sandbox.execute("python", code).exit_code == 0
  res = score_bounded(inst, sandbox)
  assert res.task_score < 1.0 and res.stage_items["S5"]["submission_complete"] is False
  if attack != "fifo":
    assert res.task_score == 0.0 and res.stage_items["S5"]["submission_native_schema"] is False
    assert res.reward < 0.9


def test_plan_linked_to_a_host_file_earns_nothing(finished, tmp_path):
  inst, sandbox = _clone(finished, tmp_path)
  (tmp_path / "plan.md").write_text((sandbox.workspace / A["plan"]).read_text())
  code = f"import os\nos.remove({A['plan']!r})\nos.symlink({str(tmp_path / 'plan.md')!r}, {A['plan']!r})"
  assert sandbox.execute("python", code).exit_code == 0
  res = score_bounded(inst, sandbox)
  assert res.stage_items["S1"]["plan_written"] is False


def test_receipt_claims_are_recomputed_not_believed(finished, tmp_path):
  inst, sandbox = _clone(finished, tmp_path)
  # Drop two cases from the submission and claim in the receipt that nothing is missing.
  code = ("import os\nnames = sorted(os.listdir('submission/labels'))\n"
          "for n in names[:2]: os.remove('submission/labels/' + n)\n") + _RECEIPT_FOR_LINKS
  assert sandbox.execute("python", code).exit_code == 0
  res = score_bounded(inst, sandbox)
  # The receipt is well formed, but it hands off an incomplete submission: nothing counts.
  assert res.stage_items["S5"]["handed_off"] is False
  assert res.stage_items["S5"]["submission_validated"] is False
  # Predictions for the wrong cases, with a receipt claiming full coverage.
  n = len(inst.hidden["case_ids"])
  code = ("import hashlib, json\nrows = [json.loads(l) for l in open('outputs/predictions.jsonl')]\n"
          "rows[0]['case_id'] = 'not_a_case'\n"
          "open('outputs/predictions.jsonl', 'w').write(''.join(json.dumps(r) + '\\n' for r in rows))\n"
          "d = hashlib.sha256(open('outputs/predictions.jsonl', 'rb').read()).hexdigest()\n"
          f"json.dump({{'stage': 'S4', 'files': {{'outputs/predictions.jsonl': d}}, 'checks': "
          f"{{'missing': [], 'predicted': {n}}}}}, open('outputs/receipt.json', 'w'))\n")
  assert sandbox.execute("python", code).exit_code == 0
  res = score_bounded(inst, sandbox)
  assert res.stage_items["S4"] == {"all_cases_inferred": False, "outputs_persisted": False,
                                   "coverage_checked": False}
  assert "not the model's output" in res.details["S4"]["coverage_checked"]
