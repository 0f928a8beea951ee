"""Task generators: determinism, variety, hidden answers kept out, faults planted as promised."""

import json

import pytest

from bat_jax import workflow
from bat_jax.tasks import FAMILIES, TRAIN_NAMES, NamePool, brief_for
from bat_jax.tasks import metrics
from bat_jax.tasks.runners import _common
from bat_jax.tasks.scripts import checks, convert

CELLS = [(t, o) for t in workflow.TRACKS for o in workflow.OUTCOMES]


def test_every_track_has_a_family():
  assert set(FAMILIES) == set(workflow.TRACKS)
  assert all(f.track == t for t, f in FAMILIES.items())


@pytest.mark.parametrize("track,outcome", CELLS)
def test_generate_is_deterministic_and_well_formed(track, outcome):
  a = FAMILIES[track].generate(3, outcome)
  b = FAMILIES[track].generate(3, outcome)
  assert a == b
  spec = a.spec
  assert spec["track"] == track and a.outcome == outcome and a.task_id == spec["task_id"]
  assert spec["data"]["index"] in a.files and spec["model"]["card"] in a.files
  hidden = a.hidden
  assert hidden["fault"] in (workflow.FAULTS[outcome] or (None,))
  # Hidden answers never enter the workspace.
  assert "truth" not in json.dumps(spec) and "expected" not in json.dumps(spec)
  for rel, data in a.files.items():
    assert not rel.startswith("/") and ".." not in rel
    for cid in hidden["case_ids"]:
      truth = hidden["truth"][cid]
      if not isinstance(truth, str):  # labels / answers legitimately occur in model files
        assert json.dumps(truth).encode() not in data, (rel, cid)
  # The provided model is right on clean data, and validation exposes degeneracy.
  for cid in hidden["case_ids"]:
    assert metrics.case_score(track, hidden["truth"][cid], hidden["expected"][cid]) >= 0.97
  good = [hidden["expected"][c] for c in hidden["validation_ids"] if c not in hidden["excluded"]]
  assert len(good) >= 2 and not checks.degenerate(good, spec["prediction_schema"])
  assert all(checks.prediction_ok(p, spec["prediction_schema"]) for p in good)
  # Briefs point at the spec and never carry answers.
  for focus in workflow.FOCI:
    text = brief_for(a, focus)
    assert workflow.ARTIFACTS["spec"] in text
    assert hidden["case_ids"][0] not in text


@pytest.mark.parametrize("track", workflow.TRACKS)
def test_values_and_names_vary_across_seeds(track):
  tasks = [FAMILIES[track].generate(s, "success") for s in range(12)]
  for key in (lambda t: t.hidden["case_ids"][0], lambda t: t.spec["data"]["index"],
              lambda t: t.spec["model"]["card"], lambda t: t.hidden["weights"],
              lambda t: t.task_id, lambda t: json.dumps(t.hidden["truth"])):
    assert len({key(t) for t in tasks}) >= 6
  assert len({t.hidden["n_cases"] for t in tasks}) >= 2
  assert len({t.hidden["maxval"] for t in tasks}) >= 2


def test_name_pool_changes_the_workspace():
  other = NamePool(salt="heldout", case_prefixes=("zz",), data_dirs=("vault",),
                   index_names=("roster",), model_words=("quill",), weight_stems=("blob",),
                   missing_modules=("nopemod",), labels=("alpha", "beta", "gamma"))
  a = FAMILIES["classification"].generate(0, "success", TRAIN_NAMES)
  b = FAMILIES["classification"].generate(0, "success", other)
  assert a.task_id != b.task_id
  assert all(c.startswith(("zz", "ZZ")) for c in b.hidden["case_ids"])
  assert b.spec["data"]["index"].startswith("data/vault_")
  assert set(b.spec["prediction_schema"]["labels"]) <= {"alpha", "beta", "gamma"}


def test_unknown_outcome_is_named():
  with pytest.raises(ValueError, match="partly"):
    FAMILIES["vqa"].generate(0, "partly")


def _find(track, fault):
  outcome = next(o for o, fs in workflow.FAULTS.items() if fault in fs)
  for seed in range(60):
    inst = FAMILIES[track].generate(seed, outcome)
    if inst.hidden["fault"] == fault:
      return inst
  raise AssertionError(f"no {fault} task in 60 seeds")


def _card(inst):
  return json.loads(inst.files[inst.spec["model"]["card"]])


def test_fault_corrupted_case_breaks_its_input():
  inst = _find("segmentation", "corrupted_case")
  bad = inst.hidden["fault_subject"]
  assert inst.hidden["excluded"] == [bad] and bad in inst.hidden["validation_ids"]
  assert bad not in inst.hidden["case_ids"]
  index = inst.files[inst.spec["data"]["index"]].decode().splitlines()
  image = next(line.split(",")[1] for line in index if line.startswith(bad + ","))
  with pytest.raises(ValueError, match="truncated"):
    _common.parse_pgm(inst.files[f"{inst.hidden['data_dir']}/{image}"].decode(), image)


def test_fault_corrupted_case_without_images_garbles_the_index_row():
  inst = _find("synthesis", "corrupted_case")
  index = inst.files[inst.spec["data"]["index"]].decode()
  row = next(line for line in index.splitlines() if line.startswith(inst.hidden["fault_subject"]))
  assert any(bad in row for bad in ("n/a", "??", "#REF!"))


def test_fault_version_mismatch_and_converter(tmp_path):
  inst = _find("detection", "version_mismatch")
  card, weights = _card(inst), json.loads(inst.files[inst.hidden["weights"]])
  supported = card["runner"]["supports_format_versions"]
  assert weights["format_version"] not in supported and card["format_version"] not in supported
  src, dst = tmp_path / "w.json", tmp_path / "out.json"
  src.write_bytes(inst.files[inst.hidden["weights"]])
  assert convert.main([str(src), str(dst), "--to", str(supported[0])]) == 0
  converted = json.loads(dst.read_text())
  assert converted["format_version"] == supported[0]
  assert converted["params"] == json.loads(weights["params_json"])


def test_fault_degenerate_output_card_scale():
  inst = _find("classification", "degenerate_output")
  assert _card(inst)["preprocess"]["intensity_scale"] == 255 and inst.hidden["maxval"] == 4095


def test_fault_missing_dependency_is_imported_by_the_runner():
  inst = _find("vqa", "missing_dependency")
  module = inst.hidden["fault_subject"]
  assert module in _card(inst)["requires"] and inst.hidden["env_missing"] == [module]
  runner = inst.files[inst.spec["model"]["card"].replace("card.json", "runner.py")].decode()
  assert f"import {module}" in runner


def test_fault_corrupted_checkpoint_hash_mismatch():
  inst = _find("report", "corrupted_checkpoint")
  data = inst.files[inst.hidden["weights"]]
  with pytest.raises(ValueError):
    json.loads(data)
  import hashlib
  assert hashlib.sha256(data).hexdigest() != _card(inst)["sha256"]


@pytest.mark.parametrize("track", workflow.TRACKS)
def test_runner_source_is_standalone_stdlib(track):
  inst = FAMILIES[track].generate(0, "success")
  runner = inst.files[inst.spec["model"]["card"].replace("card.json", "runner.py")].decode()
  compile(runner, "runner.py", "exec")
  assert "bat_jax" not in runner and "from ." not in runner
  assert f"SUPPORTED_FORMATS = ({inst.hidden['supported_formats'][0]},)" in runner
