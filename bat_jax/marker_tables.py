"""The hashed export of held-out markers: its constants, tokenisation and tables.

The scheme (version 4) is described in `bat_jax.markers`, which re-exports everything public
here; this module is the export side (`export_markers`), the matcher lives there.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from bat_jax import marker_fuzzy
from bat_jax.text_normal import caesar, leet_fold, normalize_text

SCHEME = "bat_jax.markers/v4"
MIN_MARKER_CHARS = 4
DEFAULT_WINDOW = 8
SQUASH_MIN = 5   # squashed markers at least this long are found glued into any text
SQUASH_MAX = 80  # longer ones (report text) are found by token windows and n-gram groups
GRAM_N = 4
JUNCTION_SPAN = 2  # a string value is joined with each of the next two (see `find`)
JUNCTION_CHARS = 48  # squashed chars before a boundary that a split marker may start within
GRAM_HITS = 2
LEET_SQUASH_MIN = 8
CAESAR_MIN_LETTERS = 4  # Caesar shifts other than rot13 only for markers with this many letters
_TOKEN_RE = re.compile(r"[^\W_]+")
_JOIN = "\x1f"
# All-hex squashed forms (numbers, hex ids) occur by chance inside every digest: they are matched
# on token boundaries only, never glued into other text.
_HEXISH_RE = re.compile(r"[0-9a-f]+")


def normalize_tokens(text: str) -> tuple[str, ...]:
  """The alphanumeric tokens of `normalize_text(text)`."""
  return tuple(_TOKEN_RE.findall(normalize_text(text)))


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


def _forms(normal: str, window: int) -> dict[str, bool]:
  """{form: whether it is matched glued too}: a normalised marker as written, reversed, rot13'd,
  leet-folded and (short markers) in every other Caesar shift, those as whole tokens only
  (squashed, 25 shifts of every marker would fill the anchor table: each text position would
  hit some anchor by chance and cost a second hash)."""
  squashed = "".join(_TOKEN_RE.findall(normal))
  # The leet fold turns digits into letters, so a hex id or digest folds into letters that a
  # short or all-hex marker's fold would match by chance: glued only from 8 chars, not hex.
  leet_glued = len(squashed) >= LEET_SQUASH_MIN and not _HEXISH_RE.fullmatch(squashed)
  forms = {normal: True, normal[::-1]: True, caesar(normal, 13): True}
  forms.setdefault(leet_fold(normal), leet_glued)
  # Few letters give few distinct shifts: "qr-895" shifted by 15 is "fg 895", a synthesis spec's
  # foreground level, so a marker needs CAESAR_MIN_LETTERS letters to be matched in every shift.
  if (len(_TOKEN_RE.findall(normal)) <= window
      and sum(c.isalpha() for c in normal) >= CAESAR_MIN_LETTERS):
    for shift in range(1, 26):
      forms.setdefault(caesar(normal, shift), False)
  return forms


class _ExportTables:
  """Accumulates the hash tables of `export_markers`."""

  def __init__(self, salt: bytes, window: int, public_grams: frozenset):
    self.base, self.window, self.public_grams = _hasher(salt), window, public_grams
    self.public_pairs = marker_fuzzy.public_pairs(public_grams)
    self.hashes: dict[int, set[str]] = {}
    self.squash: dict[int, set[str]] = {}
    self.anchors: dict[str, set[int]] = {}
    self.groups: set[tuple[str, ...]] = set()
    self.shingles: set[tuple[str, ...]] = set()
    self.vocab: set[str] = set()
    self.prefixes: set[str] = set()
    # First tokens of every window of n >= 2 tokens, by n, and of every n-gram ("gram").
    self.firsts: dict[int | str, set[str]] = {}

  def _hash(self, payload: str) -> str:
    return _hash_tokens(self.base, [payload])

  def add(self, normal: str) -> None:
    for form, glued in _forms(normal, self.window).items():
      tokens = tuple(_TOKEN_RE.findall(form))
      n = min(len(tokens), self.window)
      grams = self.hashes.setdefault(n, set())
      for j in range(len(tokens) - n + 1):
        grams.add(_hash_tokens(self.base, tokens[j:j + n]))
        if n > 1:
          self.firsts.setdefault(n, set()).add(self._hash(tokens[j]))
      squashed = "".join(tokens)
      if glued and SQUASH_MIN <= len(squashed) <= SQUASH_MAX and not _HEXISH_RE.fullmatch(squashed):
        self.squash.setdefault(len(squashed), set()).add(self._hash(squashed))
        anchor = self._hash(squashed[:SQUASH_MIN])
        self.anchors.setdefault(anchor, set()).add(len(squashed))
    tokens = tuple(_TOKEN_RE.findall(normal))
    self._add_fuzzy(tokens)
    if len(tokens) > self.window - 2:
      kept = [j for j in range(len(tokens) - GRAM_N + 1)
              if tokens[j:j + GRAM_N] not in self.public_grams]
      group = {_hash_tokens(self.base, tokens[j:j + GRAM_N]) for j in kept}
      if len(group) >= GRAM_HITS:
        self.groups.add(tuple(sorted(group)))
        self.firsts.setdefault("gram", set()).update(self._hash(tokens[j]) for j in kept)

  def _add_fuzzy(self, tokens: tuple[str, ...]) -> None:
    """Shingles of a long marker; prefixes of one matched squashed (`bat_jax.marker_fuzzy`)."""
    pairs = marker_fuzzy.shingle_group(tokens, self.public_pairs)
    if pairs:
      self.shingles.add(tuple(sorted(self._hash(marker_fuzzy.pair_payload(*p))
                                     for p in pairs)))
      self.vocab.update(self._hash(t) for p in pairs for t in p)
    squashed = "".join(tokens)
    if SQUASH_MIN <= len(squashed) <= SQUASH_MAX and not _HEXISH_RE.fullmatch(squashed):
      self.prefixes.update(map(self._hash, marker_fuzzy.prefixes(squashed)))

  def to_json(self) -> dict[str, Any]:
    fuzzy = marker_fuzzy
    return {
        "hashes": {str(n): sorted(h) for n, h in sorted(self.hashes.items()) if h},
        "squash": {str(n): sorted(h) for n, h in sorted(self.squash.items())},
        "anchors": {a: sorted(ls) for a, ls in sorted(self.anchors.items())},
        "firsts": {str(k): sorted(h) for k, h in sorted(self.firsts.items(), key=str)},
        "grams": {"n": GRAM_N, "min_hits": GRAM_HITS, "groups": sorted(self.groups)},
        "shingles": {"span": fuzzy.SHINGLE_SPAN, "containment": fuzzy.SHINGLE_CONTAINMENT,
                     "min_hits": fuzzy.SHINGLE_MIN_HITS, "vocab": sorted(self.vocab),
                     "groups": sorted(self.shingles)},
        "pieces": {"gap_tokens": fuzzy.GAP_TOKENS, "prefixes": sorted(self.prefixes)},
    }


def export_markers(strings: Iterable[str], salt: str | bytes, *, window: int = DEFAULT_WINDOW,
                   public_grams: Iterable[tuple[str, ...]] = ()) -> dict[str, Any]:
  """Hashes held-out marker strings into a JSON-able export that holds no plaintext.

  Args:
    strings: the marker strings (task ids, answers, file names, report text).
    salt: a per-export salt, stored in the export as hex.
    window: markers longer than this many tokens are exported as all their `window`-token
      windows (see the module docstring).
    public_grams: `GRAM_N`-token tuples that public text uses too: left out of the n-gram groups
      (and their skip-pairs out of the shingles).

  Returns:
    `{"scheme", "salt_hex", "min_chars", "window", "marker_count", "hashes", "squash",
    "anchors", "grams", "shingles", "pieces"}`, hashes sorted and deduplicated so the export
    reveals no order.
  """
  if window < GRAM_N:
    raise ValueError(f"marker window must be >= {GRAM_N}, got {window}")
  salt_b = _salt_bytes(salt)
  tables = _ExportTables(salt_b, window, frozenset(public_grams))
  count = 0
  for i, s in enumerate(strings):
    if not isinstance(s, str):
      raise TypeError(f"marker #{i} must be a str, got {type(s).__name__}")
    normal = normalize_text(s)
    if len(" ".join(_TOKEN_RE.findall(normal))) < MIN_MARKER_CHARS:
      continue
    count += 1
    tables.add(normal)
  return {
      "scheme": SCHEME,
      "salt_hex": salt_b.hex(),
      "min_chars": MIN_MARKER_CHARS,
      "window": window,
      "marker_count": count,
      **tables.to_json(),
  }


def export_digest(export: Mapping[str, Any]) -> str:
  """sha256 of the export's canonical JSON: the id a leak receipt records."""
  blob = json.dumps(export, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
  return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def empty_export(salt: str | bytes = b"") -> dict[str, Any]:
  """An export with no markers (tests and explicitly allowed development builds only)."""
  return export_markers((), salt)
