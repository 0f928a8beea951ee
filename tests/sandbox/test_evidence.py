"""Evidence log records: append, load, validation naming the bad line and field."""

import dataclasses
import json

import pytest

from bat_jax.sandbox import EvidenceRecord, load_evidence
from bat_jax.sandbox.evidence import append_record


def _rec(i: int, **kw) -> EvidenceRecord:
  base = dict(call_index=i, language="python", code_sha256="a" * 64, exit_code=0,
              duration_s=0.5, timed_out=False, fingerprint_before="b" * 64,
              fingerprint_after="c" * 64, changed={"out.txt": "d" * 64, "gone.txt": None})
  return EvidenceRecord(**{**base, **kw})


def test_append_and_load_round_trip(tmp_path):
  path = tmp_path / "ev.jsonl"
  recs = [_rec(0), _rec(1, exit_code=137, timed_out=True, limit_hit="wall", changed={})]
  for r in recs:
    append_record(path, r)
  assert load_evidence(path) == recs
  assert path.read_text().count("\n") == 2


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("exit_code"), "missing field"),
    (lambda d: d.update(extra=1), "unknown field"),
    (lambda d: d.update(code_sha256="xyz"), "'code_sha256'"),
    (lambda d: d.update(timed_out="no"), "'timed_out'"),
    (lambda d: d.update(changed={"f": "nothex"}), "'f'"),
    (lambda d: d.update(call_index=5), "call_index 5 out of order"),
    (lambda d: d.update(duration_s=-1), "'duration_s'"),
])
def test_load_names_bad_line_and_field(tmp_path, mutate, message):
  path = tmp_path / "ev.jsonl"
  append_record(path, _rec(0))
  bad = dataclasses.asdict(_rec(1))
  mutate(bad)
  with open(path, "a") as f:
    f.write(json.dumps(bad) + "\n")
  with pytest.raises(ValueError, match=message) as e:
    load_evidence(path)
  assert f"{path}:2" in str(e.value)


def test_load_reports_non_json_and_truncated_lines(tmp_path):
  path = tmp_path / "ev.jsonl"
  path.write_text("{not json}\n")
  with pytest.raises(ValueError, match=r"ev.jsonl:1: not valid JSON"):
    load_evidence(path)
  path.write_text(_rec(0).to_json())  # a crash before the newline
  with pytest.raises(ValueError, match=r"ev.jsonl:1: truncated"):
    load_evidence(path)
