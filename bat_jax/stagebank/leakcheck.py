"""The leakage pre-check: fail-closed, a round with one bad row is rejected whole.

A row is bad when it holds, anywhere in its nested keys and values:

- `forbidden_field`: a field named like held-out answer, expected answer, evaluation report,
  evaluator trace, rollout transcript, teacher completion, workspace path or correction text. Names
  are compared after dropping case and every non-alphanumeric character, and a plural `s`, so
  `expected_answer`, `ExpectedAnswer`, `expected-answers` and `Expected Answer` all match. Names
  are matched whole: `rollout_transcript_reuse_allowed` (a flag in the reference row) is not
  `rollout_transcript`.
- `absolute_path`: an absolute host path (`/home/..`, `~/..`, `C:\\..`) in a key or value. Paths
  that exist inside the sandbox (`/workspace`, `/dev/null`, interpreters) are allowed: that is
  where the agent works, and no host path is ever mounted there.
- `heldout_marker`: a held-out marker of the evaluator's hashed export (see `bat_jax.markers`).
- `reuse_flag`: a field whose name contains "reuse" with any value other than false / 0 / null /
  "false" / "no" / "".

The receipt records rows checked, rejections by reason, the digest of the marker export and, per
pool, the sha256 of the checked rows' canonical encodings (`rows_sha256`: the reader rechecks it
against the shards), and never plaintext markers.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any, Iterable, Mapping

from bat_jax.markers import MarkerMatcher
from bat_jax.stagebank import shards

REASONS: tuple[str, ...] = ("forbidden_field", "absolute_path", "heldout_marker", "reuse_flag")
FORBIDDEN_FIELDS: tuple[str, ...] = (
    "held-out answer", "expected answer", "evaluation report", "evaluator trace",
    "rollout transcript", "teacher completion", "workspace path", "correction text")
# Absolute paths that name places inside the sandbox, not the host: the workspace mount, std
# streams and the read-only system tree (interpreters; tracebacks name /usr/lib/python3.x/...).
SANDBOX_PATHS: tuple[str, ...] = (
    "/workspace", "/dev/null", "/dev/stdin", "/dev/stdout", "/dev/stderr", "/usr", "/bin",
    "/lib", "/lib64", "/sbin")
_FALSE_STRINGS = frozenset({"", "false", "no", "0", "none", "null"})
_MAX_SAMPLES = 20
WORKSPACE_TEXT_BYTES = 64 * 1024

# A `/`-rooted path that starts a token: at the start, or after whitespace, a quote or one of
# `=:([{,;<>|`. So "and/or", "1/2", "models/*/card.json", "${d}/x" and URLs are not host paths.
# Also `~/` home paths and Windows drive paths.
_POSIX_PATH_RE = re.compile(r"(?<![^\s\"'`=:(\[{,;<>|])/[\w.\-]+(?:/[\w.\-]*)*")
_OTHER_PATH_RE = re.compile(r"(?<![\w/])~/[\w.\-]+|(?<![\w])[A-Za-z]:\\[\w.\-]")
# An ASCII Netpbm raster (P1 bitmap, P2 graymap, P3 pixmap): its lines of bare integers are
# pixels (and the size / maxval header), not text; comments and any other line are text.
_NETPBM_ASCII_RE = re.compile(r"P[123]\s")
_INTEGER_LINE_RE = re.compile(r"[0-9 \t\r]*")


def squash_name(name: str) -> str:
  """Field-name normal form: lowercase alphanumerics only, one plural `s` dropped."""
  squashed = re.sub(r"[\W_]+", "", name.casefold())
  return squashed[:-1] if squashed.endswith("s") else squashed


_FORBIDDEN_SQUASHED = {squash_name(f): f for f in FORBIDDEN_FIELDS}


@dataclasses.dataclass(frozen=True)
class LeakFinding:
  """One reason a row was rejected.

  Attributes:
    row: index of the row in the checked sequence.
    pool: the row's pool.
    reason: one of `REASONS`.
    path: where in the row (`$.extra_info.expected_answer`).
    detail: what matched (the canonical forbidden name, the path, a marker digest prefix).
  """
  row: int
  pool: str
  reason: str
  path: str
  detail: str


@dataclasses.dataclass(frozen=True)
class LeakReceipt:
  """The result of checking a round. `passed` only when no row was rejected."""
  rows_checked: int
  rows_rejected: int
  rejections_by_reason: Mapping[str, int]
  marker_export_digest: str
  marker_count: int
  samples: tuple[LeakFinding, ...]
  allow_no_markers: bool = False
  rows_sha256: Mapping[str, str] = dataclasses.field(default_factory=dict)

  @property
  def passed(self) -> bool:
    return self.rows_rejected == 0

  def to_json(self) -> dict[str, Any]:
    return {
        "passed": self.passed,
        "rows_checked": self.rows_checked,
        "rows_rejected": self.rows_rejected,
        "rejections_by_reason": dict(self.rejections_by_reason),
        "marker_export_digest": self.marker_export_digest,
        "marker_count": self.marker_count,
        "allow_no_markers": self.allow_no_markers,
        "rows_sha256": dict(self.rows_sha256),
        "samples": [dataclasses.asdict(f) for f in self.samples],
    }


class RoundRejected(RuntimeError):
  """A round failed the leakage pre-check; nothing of it may be written."""

  def __init__(self, receipt: LeakReceipt):
    reasons = ", ".join(f"{k}={v}" for k, v in receipt.rejections_by_reason.items() if v)
    first = receipt.samples[0] if receipt.samples else None
    where = (f"; first: row {first.row} ({first.pool}) {first.reason} at {first.path}"
             if first else "")
    super().__init__(f"leak pre-check rejected {receipt.rows_rejected} of "
                     f"{receipt.rows_checked} rows ({reasons}){where}")
    self.receipt = receipt


def _is_true_flag(value: Any) -> bool:
  if value is None or value is False:
    return False
  if isinstance(value, (int, float)):
    return value != 0
  if isinstance(value, str):
    return value.strip().casefold() not in _FALSE_STRINGS
  return True  # containers, objects: not a clear "false", so fail closed


def workspace_text(content: bytes | str) -> str:
  """The text of a workspace file the pre-check scans (see `LeakChecker.check_workspace`)."""
  if len(content) > WORKSPACE_TEXT_BYTES:
    return ""
  if isinstance(content, bytes):
    try:
      content = content.decode("utf-8")
    except UnicodeDecodeError:
      return ""
  if _NETPBM_ASCII_RE.match(content):
    content = "\n".join(line for line in content.split("\n")
                        if not _INTEGER_LINE_RE.fullmatch(line))
  return content


class LeakChecker:
  """Checks rows against the four leak reasons; memoises per-string results across a round."""

  def __init__(self, matcher: MarkerMatcher, *, allow_no_markers: bool = False,
               sandbox_paths: Iterable[str] = SANDBOX_PATHS):
    if matcher.marker_count == 0 and not allow_no_markers:
      raise ValueError("the held-out marker export holds no markers: the leak pre-check fails "
                       "closed (allow_no_markers / --allow-no-markers for development builds)")
    self.matcher = matcher
    self.allow_no_markers = bool(allow_no_markers)
    self._sandbox_paths = tuple(sandbox_paths)
    self._path_memo: dict[str, tuple[str, ...]] = {}

  def host_paths(self, text: str) -> tuple[str, ...]:
    """The absolute host paths in `text` (sandbox-internal paths excluded)."""
    cached = self._path_memo.get(text)
    if cached is not None:
      return cached
    found = []
    if "/" in text or "\\" in text:
      for m in _POSIX_PATH_RE.finditer(text):
        path = m.group(0).rstrip(".")
        if not any(path == p or path.startswith(p + "/") for p in self._sandbox_paths):
          found.append(path)
      found.extend(m.group(0) for m in _OTHER_PATH_RE.finditer(text))
    result = tuple(found)
    if len(self._path_memo) < 1_000_000:
      self._path_memo[text] = result
    return result

  def check_row(self, row: Any, *, index: int = 0, pool: str = "") -> list[LeakFinding]:
    """Every leak finding in one row."""
    findings: list[LeakFinding] = []

    def add(reason: str, path: str, detail: str) -> None:
      findings.append(LeakFinding(index, pool, reason, path, detail))

    def scan_text(text: str, path: str) -> None:
      for p in self.host_paths(text):
        add("absolute_path", path, p[:80])

    def walk(obj: Any, path: str) -> None:
      if isinstance(obj, Mapping):
        for key, value in obj.items():
          key = str(key)
          child = f"{path}.{key}"
          squashed = squash_name(key)
          if squashed in _FORBIDDEN_SQUASHED:
            add("forbidden_field", child, _FORBIDDEN_SQUASHED[squashed])
          if "reuse" in squashed and _is_true_flag(value):
            add("reuse_flag", child, repr(value)[:40])
          scan_text(key, child)
          walk(value, child)
      elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
          walk(value, f"{path}[{i}]")
      elif isinstance(obj, str):
        scan_text(obj, path)

    walk(row, "$")
    for hit in self.matcher.find(row):
      add("heldout_marker", hit.path, f"sha256:{hit.digest[:12]}")
    return findings

  def check_workspace(self, files: Mapping[str, bytes | str], *, index: int = 0,
                      pool: str = "") -> list[LeakFinding]:
    """Held-out markers in the files a row's workspace resets to: every file name, and the
    content of every UTF-8 text file up to `WORKSPACE_TEXT_BYTES` (briefs, specs, indexes,
    scripts; not binaries, nor the integer rows of ASCII image rasters, where a marker is no
    text a policy reads: their comments and any other line are scanned)."""
    findings = []
    for rel in sorted(files):
      for hit in self.matcher.find({rel: workspace_text(files[rel])}):
        findings.append(LeakFinding(index, pool, "heldout_marker", f"workspace:{rel}",
                                    f"sha256:{hit.digest[:12]}"))
    return findings

  def check_rows(self, rows: Iterable[tuple[str, Any]]) -> LeakReceipt:
    """Checks (pool, row) pairs; the receipt's `passed` is False if any row was bad."""
    by_reason = collections.Counter({r: 0 for r in REASONS})
    samples: list[LeakFinding] = []
    checked = rejected = 0
    records: dict[str, list[bytes]] = {}
    for index, (pool, row) in enumerate(rows):
      checked += 1
      records.setdefault(pool, []).append(shards.encode_row(row))
      findings = self.check_row(row, index=index, pool=pool)
      if findings:
        rejected += 1
        for reason in sorted({f.reason for f in findings}):
          by_reason[reason] += 1
        samples.extend(findings[: _MAX_SAMPLES - len(samples)])
    return LeakReceipt(rows_checked=checked, rows_rejected=rejected,
                       rejections_by_reason={r: by_reason[r] for r in REASONS},
                       marker_export_digest=self.matcher.digest,
                       marker_count=self.matcher.marker_count, samples=tuple(samples),
                       allow_no_markers=self.allow_no_markers,
                       rows_sha256={p: shards.rows_digest(r) for p, r in records.items()})
