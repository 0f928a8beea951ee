"""Read access to a finished workspace, joined with its evidence log (no link followed, bounded).

Every file the rubric reads may be hostile. Reads go through `safe_fs` (no links, no special
files, a size cap) and JSON through `safe_fs.parse_json` (bounded depth and size, strict). A file
that cannot be read or parsed reads as None, and the reason is noted (`Workspace.notes`), so the
check that wanted it scores 0 with that reason as its detail.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Protocol

from bat_jax import workflow
from bat_jax.sandbox import safe_fs
from bat_jax.sandbox import workspace as sandbox_workspace

# The largest workspace file the rubric reads (JSON / CSV / text artifacts are far smaller).
MAX_READ_BYTES = 32 << 20
# The most JSON lines the rubric parses from one JSONL artifact (tasks have a handful of cases).
MAX_JSONL_LINES = 10_000


class EvidenceLike(Protocol):
  """The fields of `bat_jax.sandbox.EvidenceRecord` the rubric reads."""
  call_index: int
  exit_code: int
  changed: Mapping[str, Optional[str]]


def norm(rel: str) -> str:
  return os.path.normpath(rel).replace(os.sep, "/")


class Workspace:
  """Read access to a finished workspace, joined with its evidence log."""

  def __init__(self, root: Path, evidence: Iterable[EvidenceLike]):
    self.root = Path(root)
    # Symlinks are fingerprinted by target string and never followed (sandbox convention).
    self._fp = sandbox_workspace.fingerprint(self.root)
    self.records = sorted(evidence, key=lambda r: r.call_index)
    # relpath -> (call_index, exit_code, digest) of the last call that changed it.
    self._last: dict[str, tuple[int, int, Optional[str]]] = {}
    for rec in self.records:
      for rel, digest in rec.changed.items():
        self._last[norm(rel)] = (rec.call_index, rec.exit_code, digest)
    self.notes: list[str] = []  # why reads / checks failed, in order (item details)

  def note(self, reason: str) -> None:
    if reason not in self.notes:
      self.notes.append(reason)

  def sha256(self, rel: str) -> Optional[str]:
    return self._fp.get(norm(rel)) if isinstance(rel, str) else None

  def produced(self, rel: str) -> bool:
    """Whether rel exists and its current bytes were written by an exit-0 executed call."""
    if not isinstance(rel, str):
      return False
    last = self._last.get(norm(rel))
    return last is not None and last[1] == 0 and last[2] is not None \
        and last[2] == self.sha256(rel)

  def call_of(self, rel: str) -> int:
    """Call index of the last change to rel (-1 when none)."""
    return self._last.get(norm(rel), (-1, 0, None))[0]

  def stage_has_evidence(self, stage: str) -> bool:
    dirs = workflow.STAGE_DIRS[stage]
    return any(rec.exit_code == 0 and any(norm(rel).split("/", 1)[0] in dirs
                                          for rel in rec.changed) for rec in self.records)

  def data(self, rel: str) -> Optional[bytes]:
    """Bytes of a fingerprinted regular file, read without following any link, refusing
    special files and anything over MAX_READ_BYTES, and only if they still match the
    fingerprint (None otherwise)."""
    digest = self.sha256(rel)
    if digest is None:
      return None
    try:
      data = safe_fs.read_bytes(self.root, norm(rel), MAX_READ_BYTES)
    except (OSError, ValueError) as e:  # link, FIFO, device, folder, too big, missing
      self.note(f"{rel}: unreadable ({e})")
      return None
    return data if hashlib.sha256(data).hexdigest() == digest else None

  def text(self, rel: str, *, produced: bool = True) -> Optional[str]:
    """Content of a regular file (None if missing, a link, binary, or -- unless
    produced=False -- not produced by an executed call)."""
    if produced and not self.produced(rel):
      return None
    data = self.data(rel)
    try:
      return None if data is None else data.decode("utf-8")
    except UnicodeDecodeError:
      self.note(f"{rel}: not UTF-8 text")
      return None

  def json(self, rel: str, *, produced: bool = True) -> Any:
    """The parsed JSON of a produced file (bounded depth and size), or None (reason noted)."""
    text = self.text(rel, produced=produced)
    try:
      return None if text is None else safe_fs.parse_json(text)
    except ValueError as e:
      self.note(f"{rel}: not parseable JSON ({e})")
      return None

  def json_lines(self, rel: str, *, produced: bool = True) -> Optional[list[Any]]:
    """The parsed lines of a JSONL file (blank lines skipped), or None when any line is not
    bounded JSON (reason noted) or the file is missing."""
    text = self.text(rel, produced=produced)
    if text is None:
      return None
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > MAX_JSONL_LINES:
      self.note(f"{rel}: {len(lines)} lines, over the {MAX_JSONL_LINES}-line cap")
      return None
    try:
      return [safe_fs.parse_json(line) for line in lines]
    except ValueError as e:
      self.note(f"{rel}: a line is not parseable JSON ({e})")
      return None

  def receipt(self, rel: str) -> Optional[dict]:
    """A valid receipt (produced; every named file produced and hash-matching) or None."""
    blob = self.json(rel)
    if not isinstance(blob, dict) or not all(k in blob for k in workflow.RECEIPT_FIELDS):
      return None
    files, receipt_checks = blob["files"], blob["checks"]
    if not isinstance(files, dict) or not isinstance(receipt_checks, dict):
      return None
    for named, digest in files.items():
      if not self.produced(named) or self.sha256(named) != digest:
        return None
    blob["files"] = {norm(k): v for k, v in files.items()}
    return blob

  def files_under(self, rel_dir: str) -> list[str]:
    prefix = norm(rel_dir) + "/"
    return sorted(rel for rel in self._fp if rel.startswith(prefix))
