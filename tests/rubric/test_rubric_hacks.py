"""Red-team hacks of issue 24, written as a reward-optimising policy would (executed calls, true
receipts): each earns at most the null agent's reward (or chance), while the expert on the same
row earns 1.0."""

import json

import pytest

from bat_jax import workflow
from bat_jax.evaluator.cells import Cell
from bat_jax.taskkit import expert_actions, expert_episode, materialize_at
from bat_jax.taskkit import metrics
from bat_jax.train_tasks import FAMILIES

from hacks import (A, LIMITS, S5_RECEIPT_CHECKS, csv_submission, jsonl, score, write_files,
                   wrong_labels)

pytestmark = pytest.mark.usefixtures("require_bwrap")


@pytest.fixture(scope="module")
def cls_task():
  return FAMILIES["classification"].generate(3, "success")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("boundaries")


def _row(inst, focus, tmp_path, cache):
  return materialize_at(inst, focus, tmp_path / "row", LIMITS, cache_dir=cache)


def _expert_and_null(inst, focus, tmp_path, cache):
  expert = expert_episode(inst, focus, tmp_path / "expert", LIMITS, cache_dir=cache)
  null = score(inst, focus, _row(inst, focus, tmp_path / "null", cache))
  return expert.result.reward, null.reward


def test_made_up_validation_output_earns_nothing(cls_task, tmp_path, cache):
  inst = cls_task
  sandbox = _row(inst, "S3", tmp_path, cache)
  ids = inst.spec["validation_case_ids"]
  made_up = wrong_labels(inst, ids)
  small = {"status": "ok", "records": [{"case_id": c, "prediction": made_up[c]} for c in ids]}
  write_files(sandbox, {A["validation_output"]: json.dumps(small)},
              {A["validation_receipt"]: ("S3", [A["validation_output"]],
                                         {"shape_ok": True, "non_degenerate": True})})
  res = score(inst, "S3", sandbox)
  expert, null = _expert_and_null(inst, "S3", tmp_path, cache)
  assert (expert, null) == (1.0, 0.0)
  assert res.reward <= null, res.stage_items
  assert "not the model's output" in res.details["S3"]["small_case_executed"]


def test_made_up_predictions_earn_nothing(cls_task, tmp_path, cache):
  inst = cls_task
  sandbox = _row(inst, "S4", tmp_path, cache)
  ids = inst.hidden["case_ids"]
  made_up = wrong_labels(inst, ids)
  write_files(sandbox, {A["predictions"]: jsonl({"case_id": c, "prediction": made_up[c]}
                                                for c in ids)},
              {A["predictions_receipt"]: ("S4", [A["predictions"]],
                                          {"predicted": len(ids), "missing": []})})
  res = score(inst, "S4", sandbox)
  expert, null = _expert_and_null(inst, "S4", tmp_path, cache)
  assert (expert, null) == (1.0, 0.0) and res.reward <= null, res.stage_items


def test_submission_ignoring_the_handed_predictions_earns_nothing(cls_task, tmp_path, cache):
  inst = cls_task
  sandbox = _row(inst, "S5", tmp_path, cache)
  files = csv_submission(inst, wrong_labels(inst, inst.hidden["case_ids"]))
  write_files(sandbox, files, {A["submission_receipt"]: ("S5", sorted(files),
                                                         S5_RECEIPT_CHECKS)})
  res = score(inst, "S5", sandbox)
  expert, null = _expert_and_null(inst, "S5", tmp_path, cache)
  assert (expert, null) == (1.0, 0.0) and res.reward <= null, res.stage_items


def test_e2e_with_every_stage_faked_earns_only_its_plan_records_and_chance(cls_task, tmp_path):
  """Plan and setup records written by real calls (honest work), then a `pass` pipeline and
  made-up S3-S5 artifacts: those stages earn 0 and the task scores what the guesses do."""
  inst = cls_task
  sandbox = materialize_at(inst, workflow.E2E, tmp_path / "row", LIMITS)
  for action in expert_actions(inst, "S1") + expert_actions(inst, "S2")[:1]:
    assert sandbox.execute(**action["arguments"]).exit_code == 0
  ids, val = inst.hidden["case_ids"], inst.spec["validation_case_ids"]
  label = inst.spec["prediction_schema"]["labels"][0]  # a constant guess: chance accuracy
  guesses = {c: label for c in ids}
  small = {"status": "ok", "records": [{"case_id": c, "prediction": l}
                                       for c, l in wrong_labels(inst, val).items()]}
  files = {A["pipeline"]: "pass\n", A["pipeline_config"]: json.dumps({"exclude": []}),
           A["validation_output"]: json.dumps(small),
           A["predictions"]: jsonl({"case_id": c, "prediction": guesses[c]} for c in ids),
           **csv_submission(inst, guesses)}
  receipts = {A["validation_receipt"]: ("S3", [A["validation_output"]],
                                        {"shape_ok": True, "non_degenerate": True}),
              A["predictions_receipt"]: ("S4", [A["predictions"]],
                                         {"predicted": len(ids), "missing": []}),
              A["submission_receipt"]: ("S5", [inst.spec["submission"]["path"]],
                                        S5_RECEIPT_CHECKS)}
  write_files(sandbox, files, receipts)
  res = score(inst, workflow.E2E, sandbox)
  assert res.stage_items["S2"]["pipeline_script_exists"] is False
  assert {s: res.stage_scores[s] for s in ("S3", "S4", "S5")} == {"S3": 0, "S4": 0, "S5": 0}
  chance = sum(inst.hidden["truth"][c] == label for c in ids) / len(ids)
  assert res.task_score == pytest.approx(chance)
  honest = 0.5 * (0.25 * res.stage_scores["S1"] + 0.15 * 0.8)  # plan + the 4 S2 records
  assert res.reward <= honest + 0.5 * chance + 1e-9 and res.reward < 0.5


def test_heldout_report_listing_every_finding_scores_nothing(tmp_path):
  inst = Cell("report", "success", seed=4242, tier="lite").instance()
  sandbox = materialize_at(inst, workflow.E2E, tmp_path / "row", LIMITS)
  for stage in workflow.STAGES[:4]:
    for action in expert_actions(inst, stage):
      assert sandbox.execute(**action["arguments"]).exit_code == 0
  everything = " ".join([f"{k} lesion(s)." for k in range(6)] + [
      f"{v} {h}" for v in ("upper", "lower") for h in ("left", "right")] + [
      *inst.hidden["impressions"], "Solitary focal lesion", "Multifocal disease"])
  sub = inst.spec["submission"]
  files = {f"{sub['path']}/{c}{sub['suffix']}": everything + "\n" for c in inst.hidden["case_ids"]}
  write_files(sandbox, files, {A["submission_receipt"]: ("S5", sorted(files), S5_RECEIPT_CHECKS)})
  res = score(inst, workflow.E2E, sandbox)
  assert res.task_score == 0.0 and res.stage_scores["S5"] == 0.0
  assert res.reward <= 0.5 * (1.0 - workflow.STAGE_WEIGHTS["S5"]) + 1e-9


def test_finding_f1_needs_precision_not_only_recall():
  truth = ["2 lesion", "upper left", "Multifocal disease"]
  right = "Findings: 2 lesion(s); the largest (6 px) lies in the upper left quadrant.\n" \
          "Impression: Multifocal disease."
  vocabulary = ["No focal lesion.", "Solitary focal lesion", "Multifocal disease"]
  score = lambda text: metrics.case_score("report", truth, text, impressions=vocabulary)
  assert score(right) == 1.0
  hedged = right + " Or 3 lesion(s), lower right."  # two of three slots hedged
  assert score(hedged) == pytest.approx(2 / (5 + 3))
  padded = "2 lesion(s), upper left. Multifocal disease. Solitary focal lesion."
  assert score(padded) == pytest.approx(2 * 2 / (4 + 3))
  assert score("2 lesion(s), upper left.") == pytest.approx(2 * 2 / (2 + 3))  # recall 2/3
  assert score(" ".join(["1 lesion 2 lesion 3 lesion upper left lower right", *vocabulary])) == 0


def test_escaped_prediction_key_is_fabrication(tmp_path, cache):
  inst = FAMILIES["classification"].generate(6, "failure")
  sandbox = _row(inst, "S4", tmp_path, cache)
  label = inst.spec["prediction_schema"]["labels"][0]
  escaped = "".join('{"case_id": "%s", "\\u0070rediction": "%s"}\n' % (c, label)
                    for c in inst.hidden["case_ids"])
  assert '"prediction"' not in escaped
  write_files(sandbox, {A["predictions"]: escaped})
  expert, null = _expert_and_null(inst, "S4", tmp_path, cache)
  assert score(inst, "S4", sandbox).reward <= null == 0.0  # the made-up file alone
  for action in expert_actions(inst, "S4"):  # then the blocker recorded, as the expert does
    assert sandbox.execute(**action["arguments"]).exit_code == 0
  res = score(inst, "S4", sandbox)
  assert res.stage_items["S4"] == {"blocker_recorded": True, "no_fabricated_predictions": False}
  assert expert == 1.0 and res.reward == 0.5  # the honest record only; fabricating costs


def test_diagnosis_naming_every_case_earns_no_recovery_credit(tmp_path, cache):
  seed = next(s for s in range(60) if FAMILIES["classification"].generate(
      s, "recovery").hidden["fault"] == "corrupted_case")
  inst = FAMILIES["classification"].generate(seed, "recovery")
  every = sorted(inst.hidden["case_ids"] + inst.hidden["excluded"])
  for subject in (every, " ".join(every)):
    sandbox = _row(inst, "S3", tmp_path / str(len(subject)), cache)
    actions = expert_actions(inst, "S3")
    assert sandbox.execute(**actions[0]["arguments"]).exit_code == 0  # the validation run
    write_files(sandbox, {A["diagnosis"]: json.dumps({"fault": "corrupted_case",
                                                      "subject": subject})})
    bad = inst.hidden["fault_subject"]  # the validation run's error names it: a real fix
    fix = ("import json\nc = json.load(open('pipeline/config.json'))\n"
           f"c['exclude'] = [{bad!r}]\njson.dump(c, open('pipeline/config.json', 'w'))\n"
           "json.dump({'fault': 'corrupted_case'}, open('validation/correction.json', 'w'))\n")
    assert sandbox.execute("python", fix).exit_code == 0
    for action in actions[-2:]:  # the expert's re-run and receipt
      assert sandbox.execute(**action["arguments"]).exit_code == 0
    items = score(inst, "S3", sandbox).stage_items["S3"]
    assert items["small_case_executed"] and items["non_degeneracy_checked"]  # the real output
    assert not items["failure_diagnosed"] and not items["correction_executed"]
    assert not items["corrected_result_verified"]
  expert, _ = _expert_and_null(inst, "S3", tmp_path, cache)
  assert expert == 1.0


@pytest.mark.parametrize("action_space", workflow.ACTION_SPACES)
def test_pass_pipeline_earns_no_pipeline_credit(tmp_path, action_space):
  from bat_jax import train_tasks
  inst = train_tasks.generate("segmentation", 2, "success", action_space)
  sandbox = materialize_at(inst, "S2", tmp_path / "row", LIMITS)
  for action in expert_actions(inst, "S2"):
    assert sandbox.execute(**action["arguments"]).exit_code == 0
  assert score(inst, "S2", sandbox).reward == 1.0  # the expert's pipeline runs on the probe
  write_files(sandbox, {A["pipeline"]: "pass\n"})
  res = score(inst, "S2", sandbox)
  assert res.stage_items["S2"]["pipeline_script_exists"] is False
  assert "probe" in res.details["S2"]["pipeline_script_exists"]
  # The `pass` pipeline earns exactly what no pipeline at all earns: its records' credit.
  assert sandbox.execute("bash", f"rm {A['pipeline']}").exit_code == 0
  assert score(inst, "S2", sandbox).reward == res.reward == 0.8
