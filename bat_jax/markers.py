"""Held-out markers: a hashed export and a matcher that finds them anywhere in a nested row.

The held-out evaluator owns strings that must never reach training (task ids, answers, file
names, report text). It exports them *hashed only* with `export_markers`; the Stage Bank loads the
export into a `MarkerMatcher` and scans every row it is about to publish. The training side
therefore never holds plaintext held-out content, yet can still find it.

Matching scheme (version 1):

1. Normalise: Unicode NFKC, then `str.casefold()` ("ＣＡＳＥ" == "case", "Straße" == "strasse").
2. Tokenise: tokens are the maximal alphanumeric runs of the normalised text (regex `[^\\W_]+`;
   punctuation, `_`, `-`, `/`, `.` and whitespace all separate). "Case_0042.pgm" ->
   ("case", "0042", "pgm").
3. A marker is its token sequence. A marker whose normalised form (tokens joined by one space) is
   shorter than `MIN_MARKER_CHARS` (4) characters is ignored: such strings occur everywhere.
4. A marker of n <= `window` tokens is exported as one hash of its whole sequence. A longer marker
   (report text) is exported as the hashes of all its contiguous `window`-token windows, so any
   `window`-token overlap with it is found.
5. Hash of a token sequence: `sha256(salt_bytes + b"\\x00" + "\\x1f".join(tokens).encode())`, hex.
   The salt is stored in the export (the matcher must hash with it); it keeps the hashes from
   being matched against generic precomputed tables.
6. Matching: every string key and value of an object (recursively through dicts, lists and
   tuples; ints and floats via `repr`) is normalised and tokenised the same way, and every
   contiguous n-gram whose length n occurs in the export is hashed and looked up. So a marker is
   found case-insensitively, embedded in longer text, and in nested keys or values. A marker is
   found when it appears on token boundaries: "case_0042" is found in "see case-0042.pgm", but
   not inside the single token "mycase0042".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import unicodedata
from typing import Any, Iterable, Mapping

SCHEME = "bat_jax.markers/v1"
MIN_MARKER_CHARS = 4
DEFAULT_WINDOW = 8
_TOKEN_RE = re.compile(r"[^\W_]+")
_JOIN = "\x1f"


def normalize_tokens(text: str) -> tuple[str, ...]:
  """NFKC + casefold, then the maximal alphanumeric runs: the tokens every hash is built from."""
  return tuple(_TOKEN_RE.findall(unicodedata.normalize("NFKC", text).casefold()))


def _salt_bytes(salt: str | bytes) -> bytes:
  if isinstance(salt, bytes):
    return salt
  if isinstance(salt, str):
    return salt.encode("utf-8")
  raise TypeError(f"marker salt must be str or bytes, got {type(salt).__name__}")


def _hasher(salt: bytes):
  """A sha256 already fed with the salt; `.copy()` it per n-gram (saves rehashing the salt)."""
  return hashlib.sha256(salt + b"\x00")


def _hash_tokens(base, tokens: Iterable[str]) -> str:
  h = base.copy()
  h.update(_JOIN.join(tokens).encode("utf-8"))
  return h.hexdigest()


def export_markers(strings: Iterable[str], salt: str | bytes, *,
                   window: int = DEFAULT_WINDOW) -> dict[str, Any]:
  """Hashes held-out marker strings into a JSON-able export that holds no plaintext.

  Args:
    strings: the marker strings (task ids, answers, file names, report text).
    salt: a per-export salt, stored in the export as hex.
    window: markers longer than this many tokens are exported as all their `window`-token
      windows (see the module docstring).

  Returns:
    `{"scheme", "salt_hex", "min_chars", "window", "marker_count", "hashes": {n: [hex, ...]}}`,
    hashes sorted and deduplicated so the export reveals no order.
  """
  if window < 1:
    raise ValueError(f"marker window must be >= 1, got {window}")
  salt_b = _salt_bytes(salt)
  base = _hasher(salt_b)
  by_n: dict[int, set[str]] = {}
  count = 0
  for i, s in enumerate(strings):
    if not isinstance(s, str):
      raise TypeError(f"marker #{i} must be a str, got {type(s).__name__}")
    tokens = normalize_tokens(s)
    if len(" ".join(tokens)) < MIN_MARKER_CHARS:
      continue
    count += 1
    if len(tokens) <= window:
      by_n.setdefault(len(tokens), set()).add(_hash_tokens(base, tokens))
    else:
      grams = by_n.setdefault(window, set())
      for j in range(len(tokens) - window + 1):
        grams.add(_hash_tokens(base, tokens[j:j + window]))
  return {
      "scheme": SCHEME,
      "salt_hex": salt_b.hex(),
      "min_chars": MIN_MARKER_CHARS,
      "window": window,
      "marker_count": count,
      "hashes": {str(n): sorted(h) for n, h in sorted(by_n.items())},
  }


def export_digest(export: Mapping[str, Any]) -> str:
  """sha256 of the export's canonical JSON: the id a leak receipt records."""
  blob = json.dumps(export, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
  return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def empty_export(salt: str | bytes = b"") -> dict[str, Any]:
  """An export with no markers (a round built before any evaluator export exists)."""
  return export_markers((), salt)


@dataclasses.dataclass(frozen=True)
class MarkerHit:
  """One marker found in an object.

  Attributes:
    path: where it was found, JSONPath-like (`$.prompt[1].content`, `$.extra_info.<key>` for a
      key itself).
    in_key: True when the hit is in a dict key rather than a value.
    n_tokens: the length of the matching n-gram.
    digest: the matched hash (never the plaintext).
  """
  path: str
  in_key: bool
  n_tokens: int
  digest: str


class MarkerMatcher:
  """Finds hashed held-out markers in arbitrary nested JSON-like objects.

  Per-string results are memoised: rows of one round repeat most of their text (system prompt,
  stage instructions), so a round is scanned at the cost of its distinct strings.
  """

  def __init__(self, export: Mapping[str, Any]):
    for key in ("scheme", "salt_hex", "hashes"):
      if key not in export:
        raise ValueError(f"marker export is missing field {key!r}")
    if export["scheme"] != SCHEME:
      raise ValueError(f"marker export scheme {export['scheme']!r} is not {SCHEME!r}")
    try:
      salt = bytes.fromhex(export["salt_hex"])
    except (TypeError, ValueError) as e:
      raise ValueError(f"marker export field 'salt_hex' is not hex: {e}") from None
    self._base = _hasher(salt)
    self._hashes: dict[int, frozenset[str]] = {}
    for n, hashes in export["hashes"].items():
      if not str(n).isdigit() or int(n) < 1:
        raise ValueError(f"marker export 'hashes' key {n!r} is not a positive n-gram length")
      self._hashes[int(n)] = frozenset(hashes)
    self._lengths = tuple(sorted(n for n, h in self._hashes.items() if h))
    self.digest = export_digest(export)
    self.marker_count = int(export.get("marker_count", 0))
    self._memo: dict[str, tuple[tuple[int, str], ...]] = {}

  def find_in_text(self, text: str) -> tuple[tuple[int, str], ...]:
    """The (n_tokens, digest) of every marker occurrence in one string."""
    cached = self._memo.get(text)
    if cached is not None:
      return cached
    found = []
    if self._lengths:
      tokens = normalize_tokens(text)
      for n in self._lengths:
        table = self._hashes[n]
        for j in range(len(tokens) - n + 1):
          d = _hash_tokens(self._base, tokens[j:j + n])
          if d in table:
            found.append((n, d))
    result = tuple(found)
    if len(self._memo) < 1_000_000:  # bound memory on adversarially diverse input
      self._memo[text] = result
    return result

  def find(self, obj: Any) -> list[MarkerHit]:
    """All marker hits in `obj`, scanning every key and value recursively."""
    hits: list[MarkerHit] = []
    self._walk(obj, "$", hits)
    return hits

  def _walk(self, obj: Any, path: str, hits: list[MarkerHit]) -> None:
    if isinstance(obj, Mapping):
      for key, value in obj.items():
        child = f"{path}.{key}"
        for n, d in self.find_in_text(str(key)):
          hits.append(MarkerHit(child, True, n, d))
        self._walk(value, child, hits)
    elif isinstance(obj, (list, tuple)):
      for i, value in enumerate(obj):
        self._walk(value, f"{path}[{i}]", hits)
    elif isinstance(obj, str):
      for n, d in self.find_in_text(obj):
        hits.append(MarkerHit(path, False, n, d))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
      for n, d in self.find_in_text(repr(obj)):
        hits.append(MarkerHit(path, False, n, d))
