"""The generic workspace builder: name pools, planted faults, standalone runners."""

import hashlib
import json

import pytest

from bat_jax import workflow
from bat_jax.taskkit import FAMILY_TYPES, NamePool
from bat_jax.taskkit.runners import common
from bat_jax.taskkit.scripts import convert
from bat_jax.train_tasks import FAMILIES  # concrete tasks to inspect the builder's output
from bat_jax.train_tasks.briefs import make_brief

OTHER_NAMES = NamePool(salt="heldout", case_prefixes=("zz",), data_dirs=("vault",),
                       index_names=("roster",), model_words=("quill",), weight_stems=("blob",),
                       missing_modules=("nopemod",), labels=("alpha", "beta", "gamma"))


def test_name_pool_changes_the_workspace():
  a = FAMILIES["classification"].generate(0, "success")
  b = FAMILY_TYPES["classification"](OTHER_NAMES, make_brief).generate(0, "success")
  assert a.task_id != b.task_id
  assert all(c.startswith(("zz", "ZZ")) for c in b.hidden["case_ids"])
  assert b.spec["data"]["index"].startswith("data/vault_")
  assert set(b.spec["prediction_schema"]["labels"]) <= {"alpha", "beta", "gamma"}


def test_the_brief_writer_writes_the_brief():
  family = FAMILY_TYPES["vqa"](OTHER_NAMES, lambda rng, track, objective: f"{track}|{objective}")
  inst = family.generate(2, "recovery")
  assert inst.brief == f"vqa|{inst.spec['objective']}"


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
    common.parse_pgm(inst.files[f"{inst.hidden['data_dir']}/{image}"].decode(), image)


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
  assert hashlib.sha256(data).hexdigest() != _card(inst)["sha256"]


@pytest.mark.parametrize("track", workflow.TRACKS)
def test_runner_source_is_standalone_stdlib(track):
  inst = FAMILIES[track].generate(0, "success")
  runner = inst.files[inst.spec["model"]["card"].replace("card.json", "runner.py")].decode()
  compile(runner, "runner.py", "exec")
  assert "bat_jax" not in runner and "from ." not in runner
  assert f"SUPPORTED_FORMATS = ({inst.hidden['supported_formats'][0]},)" in runner
