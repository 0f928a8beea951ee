"""Stdlib helpers shipped into workspaces: metrics, checks, submission formats, inlining."""

import json

import pytest

from bat_jax.taskkit import metrics, sources
from bat_jax.taskkit.runners import common, detection, segmentation
from bat_jax.taskkit.scripts import checks, submission


def test_metrics_by_hand():
  assert metrics.dice([[1, 1], [0, 0]], [[1, 0], [0, 0]]) == pytest.approx(2 / 3)
  assert metrics.dice([[0]], [[0]]) == 1.0
  truth = [[0, 0, 2, 2], [5, 5, 8, 8]]
  assert metrics.detection_f1(truth, [{"box": [0, 0, 2, 2], "score": 0.9}]) == pytest.approx(2 / 3)
  assert metrics.detection_f1(truth, [{"box": b, "score": 1} for b in truth]) == 1.0
  report = "Findings: 2 lesion(s), upper LEFT"
  assert metrics.finding_f1(["2 lesion", "upper left"], report) == 1.0
  assert metrics.finding_f1(["2 lesion", "upper left"], "nothing") == 0.0
  key, vocab = ["2 lesion", "upper left", "no acute finding"], ["no acute finding", "mass"]
  assert metrics.finding_f1(key, report + ". Impression: no acute finding", vocab) == 1.0
  hedged = "2 lesion(s) or 3 lesion(s), upper left. Impression: no acute finding"
  assert metrics.finding_f1(key, hedged, vocab) == pytest.approx(2 * 2 / (4 + 3))
  listing = "1 lesion, 2 lesion, upper left, lower right; no acute finding, mass"
  assert metrics.finding_f1(key, listing, vocab) == 0.0
  assert metrics.accuracy("Left", " left ") == 1.0 and metrics.accuracy("a", 3) == 0.0
  clean = [[100, 100], [100, 100]]
  noisy = [[100, 255], [100, 100]]
  truth_e = {"clean": clean, "maxval": 255, "noisy_psnr": metrics.psnr(noisy, clean, 255)}
  assert metrics.psnr_gain(truth_e, clean) == 1.0 and metrics.psnr_gain(truth_e, noisy) == 0.0
  synth = {"mask": [[1, 0], [0, 0]], "fg": 200, "bg": 20, "maxval": 255}
  assert metrics.condition_fidelity(synth, [[200, 20], [20, 20]]) == 1.0
  assert metrics.condition_fidelity(synth, [[120, 20], [20, 20]]) == 0.0  # level off
  assert metrics.case_score("segmentation", [[1]], "garbage") == 0.0  # malformed -> 0
  with pytest.raises(ValueError, match="radiology"):
    metrics.case_score("radiology", 1, 1)


def test_checks_shape_and_degeneracy():
  img = {"type": "image", "width": 2, "height": 2, "maxval": 1}
  assert checks.prediction_ok([[0, 1], [1, 0]], img)
  assert not checks.prediction_ok([[0, 2], [1, 0]], img) and not checks.prediction_ok([[0, 1]], img)
  assert checks.degenerate([[[1, 1], [1, 1]], [[0, 1], [1, 0]]], img)  # one flat image
  assert not checks.degenerate([[[0, 1], [1, 1]], [[0, 1], [1, 0]]], img)
  label = {"type": "label", "labels": ["a", "b"]}
  assert checks.degenerate(["a", "a", "a"], label) and not checks.degenerate(["a", "b"], label)
  boxes = {"type": "boxes", "width": 4, "height": 4}
  assert checks.prediction_ok([{"box": [0, 0, 4, 4], "score": 1}], boxes)
  assert not checks.prediction_ok([{"box": [0, 0, 5, 4], "score": 1}], boxes)
  with pytest.raises(ValueError, match="volume"):
    checks.prediction_ok(1, {"type": "volume"})


def test_diagnose_names_fault_and_subject(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "w.json").write_text("{broken")
  config = {"weights": "w.json", "intensity_scale": 255}
  label = {"type": "label", "labels": ["a", "b"]}
  missing = checks.diagnose({"status": "failed", "error": "ModuleNotFoundError: No module named "
                             "'voxelops3'"}, label, config, {})
  assert (missing["fault"], missing["subject"]) == ("missing_dependency", "voxelops3")
  version = checks.diagnose({"status": "failed", "error": "ValueError: weights format_version 4"},
                            label, config, {})
  assert version["fault"] == "version_mismatch" and version["recoverable"]
  broken = checks.diagnose({"status": "failed", "error": "JSONDecodeError"}, label, config,
                           {"sha256": "0" * 64})
  assert broken["fault"] == "corrupted_checkpoint" and not broken["recoverable"]
  case = checks.diagnose({"status": "partial", "records": [
      {"case_id": "c1", "prediction": "a"}, {"case_id": "c2", "error": "ValueError: truncated"}]},
      label, config, {})
  assert (case["fault"], case["subject"]) == ("corrupted_case", "c2")
  flat = checks.diagnose({"status": "ok", "records": [
      {"case_id": "c1", "prediction": "a"}, {"case_id": "c2", "prediction": "a"}]},
      label, config, {})
  assert flat["fault"] == "degenerate_output"
  ok = checks.diagnose({"status": "ok", "records": [
      {"case_id": "c1", "prediction": "a"}, {"case_id": "c2", "prediction": "b"}]},
      label, config, {})
  assert ok == {"fault": None}


SPECS = [
    ({"format": "csv", "path": "submission/labels.csv", "id_column": "id",
      "value_column": "label"}, {"c1": "cyst", "c2": "normal"}),
    ({"format": "jsonl", "path": "submission/answers.jsonl", "id_key": "qid",
      "value_key": "answer"}, {"q1": "2", "q2": "left"}),
    ({"format": "coco_json", "path": "submission/det.json", "id_key": "image_id"},
     {"c1": [{"box": [0, 0, 2, 3], "score": 0.5}], "c2": []}),
    ({"format": "pgm_dir", "path": "submission/masks", "suffix": "_mask.pgm", "maxval": 1},
     {"c1": [[0, 1], [1, 1]], "c2": [[0, 0], [1, 0]]}),
    ({"format": "txt_dir", "path": "submission/reports", "suffix": ".txt"},
     {"c1": "Findings: one.\nImpression: fine.", "c2": "Nothing."}),
]


@pytest.mark.parametrize("spec,preds", SPECS, ids=[s["format"] for s, _ in SPECS])
def test_submission_roundtrip(tmp_path, spec, preds):
  written = submission.write_submission(spec, preds, str(tmp_path))
  assert all((tmp_path / w).is_file() for w in written)
  assert submission.read_submission(spec, str(tmp_path)) == preds


def test_submission_errors_name_the_file(tmp_path):
  spec = SPECS[0][0]
  with pytest.raises(ValueError, match="labels.csv is missing"):
    submission.read_submission(spec, str(tmp_path))
  (tmp_path / "submission").mkdir()
  (tmp_path / "submission/labels.csv").write_text("case,label\nc1,a\n")
  with pytest.raises(ValueError, match="labels.csv: header"):
    submission.read_submission(spec, str(tmp_path))
  with pytest.raises(ValueError, match="parquet"):
    submission.write_submission({"format": "parquet", "path": "x"}, {}, str(tmp_path))


def test_runners_on_a_hand_made_image():
  rows = [[10, 10, 10, 10], [10, 200, 200, 10], [10, 200, 200, 10], [10, 10, 10, 10]]
  image = common.parse_pgm(common.format_pgm(rows, 255))
  assert segmentation.predict_case({"threshold": 0.5}, {}, image, None)[1] == [0, 1, 1, 0]
  boxes = detection.predict_case({"threshold": 0.5, "min_area": 2}, {}, image, None)
  assert [b["box"] for b in boxes] == [[1, 1, 3, 3]]
  # A wrong fixed scale saturates everything: the planted degenerate fault.
  assert detection.predict_case({"threshold": 0.5, "min_area": 2}, {}, image, 5.0)[0]["box"] == \
      [0, 0, 4, 4]


def test_inline_source_standalone_and_rewrites():
  text = sources.inline_source(common, segmentation)
  assert "from .common" not in text and text.count("from __future__") == 1
  namespace = {}
  exec(compile(text, "runner.py", "exec"), namespace)  # runs without the package
  assert namespace["SUPPORTED_FORMATS"] == (2,)
  with pytest.raises(ValueError, match="NOT THERE"):
    sources.inline_source(common, replace=(("NOT THERE", "x"),))
  assert json.loads(json.dumps(namespace["binary_mask"]([[0.2, 0.9]], 0.5))) == [[0, 1]]
