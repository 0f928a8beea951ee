"""Shards, manifest, atomic publish, digest refusal and the resumable grain reader."""

import json

import pytest

from bat_jax import workflow
from bat_jax.stagebank import build
from bat_jax.stagebank import reader
from bat_jax.stagebank import rounds
from bat_jax.stagebank import shards

SPEC = rounds.RoundSpec(4, rounds.RoundWeights.for_target("S4"), seed=11, n_batches=12)


def _publish(bank, source, checker, spec=SPEC):
  return build.publish(bank, build.build_round(spec, source, checker), source_name=source.name)


@pytest.fixture
def round_dir(tmp_path, source, checker):
  return _publish(tmp_path / "bank", source, checker)


def test_manifest_records_counts_digests_config_weights_receipt(round_dir):
  manifest = shards.verify_round(round_dir)
  assert manifest["schema_version"] == shards.SCHEMA_VERSION
  assert {p: s["rows"] for p, s in manifest["shards"].items()} == {
      "s_target": 48, "s_mix": 24, "e2e": 24}
  assert manifest["total_rows"] == 96
  assert manifest["config"]["n_batches"] == 12 and manifest["config"]["seed"] == 11
  assert manifest["curriculum_weights"]["stage_weights"]["S4"] == 1.0
  assert manifest["leak_receipt"]["passed"] and manifest["leak_receipt"]["rows_checked"] == 96
  assert manifest["batch_composition"] == {"s_target": 4, "s_mix": 2, "e2e": 2}
  for shard in manifest["shards"].values():
    assert shards.sha256_file(round_dir / shard["file"]) == shard["sha256"]
  assert not [p for p in round_dir.parent.iterdir() if p.name.startswith(".tmp")]


def test_same_seed_gives_byte_identical_shards(tmp_path, source, checker, round_dir):
  again = _publish(tmp_path / "bank2", source, checker)
  for name in [p + shards.SHARD_SUFFIX for p in workflow.POOLS] + [shards.MANIFEST]:
    assert (again / name).read_bytes() == (round_dir / name).read_bytes(), name
  other = _publish(tmp_path / "bank3", source, checker,
                   rounds.RoundSpec(4, SPEC.weights, seed=12, n_batches=12))
  assert (other / "s_target.array_record").read_bytes() != \
      (round_dir / "s_target.array_record").read_bytes()


def test_republish_identical_is_noop_and_conflict_is_refused(tmp_path, source, checker, round_dir):
  assert _publish(round_dir.parent, source, checker) == round_dir
  conflicting = rounds.RoundSpec(4, rounds.RoundWeights.for_target("S1"), seed=11, n_batches=12)
  with pytest.raises(shards.RoundExistsError, match="round_000004"):
    _publish(round_dir.parent, source, checker, conflicting)
  assert shards.published_rounds(round_dir.parent) == [4]
  assert not [p for p in round_dir.parent.iterdir() if p.name.startswith(".tmp")]


def test_corrupted_shard_is_refused_naming_it(round_dir):
  path = round_dir / "s_mix.array_record"
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01
  path.write_bytes(bytes(data))
  with pytest.raises(shards.ShardDigestError, match=r"s_mix\.array_record"):
    reader.RoundReader(round_dir)
  path.unlink()
  with pytest.raises(shards.ShardDigestError, match="s_mix.*missing"):
    reader.RoundReader(round_dir)


def test_round_without_passed_receipt_is_refused(round_dir):
  manifest = json.loads((round_dir / shards.MANIFEST).read_text())
  manifest["leak_receipt"]["passed"] = False
  (round_dir / shards.MANIFEST).write_text(json.dumps(manifest))
  with pytest.raises(shards.ShardDigestError, match="leak receipt"):
    reader.RoundReader(round_dir)


def test_reader_batches_follow_the_round_composition(round_dir):
  view = rounds.plan_round(SPEC)
  batches = list(reader.RoundReader(round_dir))
  assert len(batches) == 12
  for b, batch in enumerate(batches):
    pools = [r["extra_info"]["source_pool"] for r in batch]
    assert pools == ["s_target"] * 4 + ["s_mix"] * 2 + ["e2e"] * 2
    expected = [s.state_id for s in view["s_target"][4 * b:4 * b + 4]] + \
        [s.state_id for s in view["s_mix"][2 * b:2 * b + 2]] + \
        [s.state_id for s in view["e2e"][2 * b:2 * b + 2]]
    assert [r["extra_info"]["state_id"] for r in batch] == expected


def test_reader_resume_continues_exactly(round_dir):
  kwargs = dict(num_epochs=2, shuffle_seed=5, shard_index=1, shard_count=2)
  full = [[r["extra_info"]["state_id"] for r in b] for b in reader.RoundReader(round_dir, **kwargs)]
  assert len(full) == 12
  first = reader.RoundReader(round_dir, **kwargs)
  head = [[r["extra_info"]["state_id"] for r in next(first)] for _ in range(5)]
  state = json.loads(json.dumps(first.get_state()))  # must survive a JSON checkpoint
  resumed = reader.RoundReader(round_dir, **kwargs)
  resumed.set_state(state)
  tail = [[r["extra_info"]["state_id"] for r in b] for b in resumed]
  assert head + tail == full
  with pytest.raises(ValueError, match="shard_index"):
    reader.RoundReader(round_dir, num_epochs=2, shuffle_seed=5).set_state(state)


def test_data_parallel_readers_partition_the_round(round_dir):
  parts = [list(reader.RoundReader(round_dir, shard_index=i, shard_count=3)) for i in range(3)]
  ids = [r["extra_info"]["state_id"] for p in parts for b in p for r in b]
  assert len(ids) == len(set(ids)) == 96


def test_e2e_only_round_reads_back(tmp_path, source, checker):
  e2e_only = rounds.RoundWeights({"s_target": 0, "s_mix": 0, "e2e": 1},
                                 {s: 0.2 for s in workflow.STAGES})
  round_dir = _publish(tmp_path, source, checker, rounds.RoundSpec(0, e2e_only, n_batches=2))
  batches = list(reader.RoundReader(round_dir))
  assert [len(b) for b in batches] == [8, 8]
  assert {r["extra_info"]["source_pool"] for b in batches for r in b} == {"e2e"}
