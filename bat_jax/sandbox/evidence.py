"""The evidence log: one JSONL record per executed call, kept OUTSIDE the workspace.

Rubrics grant credit only for files an executed call produced, so the log must be something
the agent cannot forge: it lives outside the sandbox's view and only the harness appends to it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class EvidenceRecord:
  """One `execute` call.

  Attributes:
    call_index: 0-based position of the call in this log.
    language: "python" or "bash".
    code_sha256: sha256 of the UTF-8 code.
    exit_code: the process exit code (128 + signal when killed).
    duration_s: wall seconds of the call.
    timed_out: whether the wall-time limit killed it.
    fingerprint_before: `fingerprint_digest` of the workspace before the call.
    fingerprint_after: `fingerprint_digest` of the workspace after the call.
    changed: {relpath: new sha256, or None when deleted} for every path the call changed.
    limit_hit: which limit stopped the call ("wall", "cpu", "memory", "procs", "output",
      "workspace", "code_size") or None.
  """
  call_index: int
  language: str
  code_sha256: str
  exit_code: int
  duration_s: float
  timed_out: bool
  fingerprint_before: str
  fingerprint_after: str
  changed: dict[str, Optional[str]]
  limit_hit: Optional[str] = None

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


def _check(cond: bool, where: str, what: str) -> None:
  if not cond:
    raise ValueError(f"{where}: {what}")


def record_from_dict(d: Any, where: str) -> EvidenceRecord:
  """Validates a decoded JSON object into an EvidenceRecord; errors name `where` and the field."""
  _check(isinstance(d, dict), where, f"expected a JSON object, got {type(d).__name__}")
  names = {f.name for f in dataclasses.fields(EvidenceRecord)}
  required = names - {"limit_hit"}
  missing, extra = sorted(required - d.keys()), sorted(d.keys() - names)
  _check(not missing, where, f"missing field(s) {missing}")
  _check(not extra, where, f"unknown field(s) {extra}")
  int_ok = lambda v: isinstance(v, int) and not isinstance(v, bool)
  _check(int_ok(d["call_index"]) and d["call_index"] >= 0, where,
         "field 'call_index' must be an int >= 0")
  _check(isinstance(d["language"], str), where, "field 'language' must be a string")
  for k in ("code_sha256", "fingerprint_before", "fingerprint_after"):
    _check(isinstance(d[k], str) and _SHA256.fullmatch(d[k]) is not None, where,
           f"field {k!r} must be a sha256 hex digest")
  _check(int_ok(d["exit_code"]), where, "field 'exit_code' must be an int")
  _check(isinstance(d["duration_s"], (int, float)) and not isinstance(d["duration_s"], bool)
         and d["duration_s"] >= 0, where, "field 'duration_s' must be a number >= 0")
  _check(isinstance(d["timed_out"], bool), where, "field 'timed_out' must be a bool")
  _check(d.get("limit_hit") is None or isinstance(d["limit_hit"], str), where,
         "field 'limit_hit' must be a string or null")
  changed = d["changed"]
  _check(isinstance(changed, dict), where, "field 'changed' must be an object")
  for rel, digest in changed.items():
    _check(digest is None or (isinstance(digest, str) and _SHA256.fullmatch(digest) is not None),
           where, f"field 'changed' entry {rel!r} must be a sha256 hex digest or null")
  return EvidenceRecord(**{**d, "duration_s": float(d["duration_s"])})


def load_evidence(path: Path) -> list[EvidenceRecord]:
  """Reads and validates a JSONL evidence log. Errors name the file and the 1-based line."""
  path = Path(path)
  records = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      where = f"{path}:{lineno}"
      if not line.endswith("\n"):
        raise ValueError(f"{where}: truncated record (no trailing newline)")
      try:
        d = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
      rec = record_from_dict(d, where)
      _check(rec.call_index == len(records), where,
             f"call_index {rec.call_index} out of order; expected {len(records)}")
      records.append(rec)
  return records


def append_record(path: Path, record: EvidenceRecord) -> None:
  """Appends one record as a single O_APPEND write.

  One write(2) of the whole line means a reader never sees a half record from a live writer,
  and a harness that dies after it loses nothing; a crash mid-write leaves a line without its
  newline, which `load_evidence` reports. No fsync per call (it cost ~4 ms, a quarter of a
  call's overhead): a host crash can lose the last records, as it loses the workspace files
  they describe (`materialize` does not sync either), and a missing record only withholds
  credit, it never grants any.
  """
  data = (record.to_json() + "\n").encode("utf-8")
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
  try:
    written = os.write(fd, data)
    if written != len(data):
      raise OSError(f"short write to evidence log {str(path)!r}: {written} of {len(data)} bytes")
  finally:
    os.close(fd)
