"""Bad rounds on disk: every one ends in an error naming the file and the problem, never a bare
exception, a hang or silent acceptance (each case is read by `verify_round` and `RoundReader`)."""

import json
import os

import pytest
from array_record.python import array_record_module

from bat_jax.stagebank import build, reader, rounds, shards

SPEC = rounds.RoundSpec(2, rounds.RoundWeights.for_target("S1"), seed=5, n_batches=3)
_CLEAR = (shards.ShardDigestError, FileNotFoundError)  # RoundFormatError is a ShardDigestError


@pytest.fixture
def round_dir(tmp_path, source, checker):
  return build.publish(tmp_path / "bank", build.build_round(SPEC, source, checker),
                       source_name=source.name)


def _manifest(rd):
  return json.loads((rd / shards.MANIFEST).read_text())


def _write_manifest(rd, manifest):
  (rd / shards.MANIFEST).write_text(json.dumps(manifest))


def _fix_digest(rd, pool="s_target"):
  m = _manifest(rd)
  m["shards"][pool]["sha256"] = shards.sha256_file(rd / m["shards"][pool]["file"])
  _write_manifest(rd, m)


def _rewrite_records(rd, records, pool="s_target", fix_receipt=False):
  path = rd / f"{pool}.array_record"
  writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    writer.write(r)
  writer.close()
  _fix_digest(rd, pool)
  if fix_receipt:
    m = _manifest(rd)
    m["leak_receipt"]["rows_sha256"][pool] = shards.rows_digest(records)
    _write_manifest(rd, m)


def _edit(key_path, value):
  def mutate(rd):
    m = _manifest(rd)
    node = m
    for k in key_path[:-1]:
      node = node[k]
    if value is _DELETE:
      del node[key_path[-1]]
    else:
      node[key_path[-1]] = value
    _write_manifest(rd, m)
  return mutate


_DELETE = object()


def _truncate(rd):
  path = rd / "s_target.array_record"
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  _fix_digest(rd)


def _rows_plus_five(rd):
  m = _manifest(rd)
  m["shards"]["s_target"]["rows"] += 5
  m["total_rows"] += 5
  m["leak_receipt"]["rows_checked"] += 5
  _write_manifest(rd, m)


def _rewritten_after_publication(rd):
  """Valid rows with a planted field, shard digest fixed up: only the receipt recheck sees it."""
  records = shards.read_records(rd / "s_target.array_record", _manifest(rd)["shards"]["s_target"]
                                ["rows"])
  rows = [json.loads(r) for r in records]
  rows[0]["extra_info"]["note"] = "swapped in after the leak pre-check"
  _rewrite_records(rd, [shards.encode_row(r) for r in rows])


def _symlinked_shard(rd):
  outside = rd.parent / "outside.array_record"
  os.rename(rd / "s_target.array_record", outside)
  os.symlink(outside, rd / "s_target.array_record")


CASES = {
    "truncated_shard_digest_fixed": (_truncate, "s_target.array_record.*(truncated|records)"),
    "empty_manifest": (lambda rd: (rd / shards.MANIFEST).write_text(""), "manifest.json.*JSON"),
    "bad_json_manifest": (lambda rd: (rd / shards.MANIFEST).write_text("{\"shards\": "),
                          "manifest.json.*JSON"),
    "binary_manifest": (lambda rd: (rd / shards.MANIFEST).write_bytes(b"\xff\xfe\x00garbage"),
                        "manifest.json.*JSON"),
    "manifest_not_object": (lambda rd: (rd / shards.MANIFEST).write_text("[1, 2]"),
                            "manifest.json.*not a JSON object"),
    "manifest_missing": (lambda rd: (rd / shards.MANIFEST).unlink(), "no manifest.json"),
    "wrong_schema_version": (_edit(["schema_version"], 99), "schema_version"),
    "missing_shards_key": (_edit(["shards"], _DELETE), "field 'shards'"),
    "empty_shards": (_edit(["shards"], {}), "field 'shards'"),
    "shard_entry_not_object": (_edit(["shards", "e2e"], "e2e.array_record"), "shards.e2e"),
    "shard_path_outside_round": (_edit(["shards", "s_target", "file"],
                                       "../outside.array_record"), "shards.s_target.file"),
    "shard_path_absolute": (_edit(["shards", "s_target", "file"], "/etc/passwd"),
                            "shards.s_target.file"),
    "shard_hidden_name": (_edit(["shards", "s_target", "file"], ".x.array_record"),
                          "shards.s_target.file"),
    "shard_missing_sha256": (_edit(["shards", "s_mix", "sha256"], _DELETE),
                             "shards.s_mix.sha256"),
    "shard_rows_not_int": (_edit(["shards", "s_mix", "rows"], "6"), "shards.s_mix.rows"),
    "shard_rows_negative": (_edit(["shards", "s_mix", "rows"], -1), "shards.s_mix.rows"),
    "total_rows_wrong": (_edit(["total_rows"], 7), "total_rows"),
    "row_count_plus_five": (_rows_plus_five, "s_target.array_record holds 12 records.*17"),
    "shard_missing": (lambda rd: (rd / "e2e.array_record").unlink(), "e2e.array_record.*missing"),
    "shard_is_symlink": (_symlinked_shard, "s_target.array_record.*not a regular file"),
    "shard_digest_mismatch": (lambda rd: (rd / "e2e.array_record").write_bytes(b"x"),
                              "e2e.array_record.*sha256"),
    "garbage_rows_non_utf8": (lambda rd: _rewrite_records(rd, [b"\xff\xfe\x80"] * 12,
                                                          fix_receipt=True),
                              "s_target.array_record record 0 is not a UTF-8 JSON row"),
    "garbage_rows_not_json": (lambda rd: _rewrite_records(rd, [b"{not json"] * 12,
                                                          fix_receipt=True),
                              "record 0 is not a UTF-8 JSON row"),
    "rewritten_after_publication": (_rewritten_after_publication,
                                    "s_target.array_record.*leak pre-check passed"),
    "receipt_without_row_digests": (_edit(["leak_receipt", "rows_sha256"], _DELETE),
                                    "rows_sha256"),
    "receipt_not_passed": (_edit(["leak_receipt", "passed"], "true"), "leak receipt"),
    "receipt_rows_checked_wrong": (_edit(["leak_receipt", "rows_checked"], 1),
                                   "leak receipt checked 1 rows"),
    "receipt_missing": (_edit(["leak_receipt"], _DELETE), "leak receipt"),
}
READER_CASES = {
    "composition_missing": (_edit(["batch_composition"], _DELETE), "batch_composition"),
    "composition_not_int": (_edit(["batch_composition", "e2e"], 2.5), "e2e 2.5"),
    "n_batches_missing": (_edit(["config", "n_batches"], _DELETE), "n_batches"),
    "n_batches_negative": (_edit(["config", "n_batches"], -3), "n_batches -3"),
    "composition_disagrees_with_rows": (_edit(["batch_composition", "e2e"], 3),
                                        "pool e2e.*needs"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_round_is_refused_naming_file_and_problem(round_dir, name):
  mutate, message = CASES[name]
  mutate(round_dir)
  with pytest.raises(_CLEAR, match=message):
    shards.verify_round(round_dir)
  with pytest.raises(_CLEAR, match=message):
    reader.RoundReader(round_dir)


@pytest.mark.parametrize("name", sorted(READER_CASES))
def test_bad_layout_is_refused_by_the_reader(round_dir, name):
  mutate, message = READER_CASES[name]
  mutate(round_dir)
  with pytest.raises(_CLEAR, match=message):
    reader.RoundReader(round_dir)


def test_untouched_round_still_reads(round_dir):
  assert sum(len(b) for b in reader.RoundReader(round_dir)) == 24


def test_bad_marker_exports_are_named(tmp_path):
  for name, text in {"empty": "", "list": "[]", "binary": "\udcff", "no_scheme": "{}",
                     "old_scheme": json.dumps({"scheme": "bat_jax.markers/v1", "salt_hex": "00",
                                               "hashes": {}, "squash": {}, "anchors": {},
                                               "grams": {}})}.items():
    path = tmp_path / f"{name}.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=f"marker export .*{name}.json"):
      build.load_matcher(path)


@pytest.mark.parametrize("how", ["copied_under_another_index", "manifest_edited"])
def test_a_round_whose_manifest_names_another_round_is_refused(round_dir, how):
  """Round 2 copied in as round 5 (every digest and the receipt still match), or its manifest
  edited to say round 7: the reader, verify_round and the daemon's wait refuse it, naming the
  manifest and both rounds."""
  import shutil
  from bat_jax.stagebank import daemon
  if how == "copied_under_another_index":
    target, named, field = round_dir.parent / shards.round_dirname(5), 2, "round"
    shutil.copytree(round_dir, target)
    index = 5
  else:
    target, named, field, index = round_dir, 7, "config.round", 2
    _edit(["config", "round"], 7)(round_dir)
  message = (f"{target / shards.MANIFEST}: field '{field}' names round {named}, but the "
             f"folder {target.name} is round {index}")
  with pytest.raises(shards.RoundFormatError, match=message):
    shards.verify_round(target)
  with pytest.raises(shards.RoundFormatError, match=message):
    reader.RoundReader(target)
  with pytest.raises(shards.RoundFormatError, match=message):
    daemon.wait_for_round(round_dir.parent, index, timeout=1)
  if how == "copied_under_another_index":
    assert shards.verify_round(round_dir)["round"] == 2  # the original still reads
