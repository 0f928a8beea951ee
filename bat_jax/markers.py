"""Held-out markers: a hashed export and a matcher that finds them anywhere in a nested row.

The held-out evaluator owns strings that must never reach training (task ids, answers, file
names, report text). It exports them *hashed only* with `export_markers`; the Stage Bank loads the
export into a `MarkerMatcher` and scans every row it is about to publish. The training side
therefore never holds plaintext held-out content, yet can still find it.

Matching scheme (version 4). Everything is hashed as `sha256(salt + b"\\x00" + payload)`:

1. Normalise (`bat_jax.text_normal.normalize_text`): NFKD, drop format characters, combining
   marks and default-ignorable code points (Hangul fillers), NFKC, the UTS #39 confusables
   mapping (Cyrillic/Greek/Cherokee/... look-alikes to the ASCII letter they imitate), casefold.
2. Tokens: the maximal alphanumeric runs of the normal form (`_`, `-`, `/`, `.`, whitespace and
   all punctuation separate). "Case_0042.pgm" -> ("case", "0042", "pgm"). The *squashed* form is
   the tokens glued together ("case0042pgm"): it is what survives removed or inserted separators,
   spaced letters and gluing into a longer word.
3. A marker whose tokens joined by one space are shorter than `MIN_MARKER_CHARS` is ignored.
4. Export tables (each entry for the marker's forms: the normal form, its reversal, its rot13,
   its leetspeak fold and, for markers of at most `window` tokens, all 25 Caesar shifts):
   - `hashes[n]`: a marker of n <= `window` tokens as one hash of its token sequence; a longer
     one as all its `window`-token windows. `firsts[n]`: the hash of every first token of an
     n-token window (n >= 2), `firsts["gram"]` of an n-gram below, so a scan hashes only the
     windows of each length that start with one (common words start only long windows).
   - `squash[L]` + `anchors`: a marker whose squashed form has `SQUASH_MIN..SQUASH_MAX` chars, as
     the hash of that form, plus the hash of its first `SQUASH_MIN` chars -> [L, ...] so a scan
     hashes each position of a text once and checks full lengths only behind an anchor hit
     (not for Caesar shifts other than rot13: those are matched as whole tokens; the leet fold
     from `LEET_SQUASH_MIN` chars and never for an all-hex marker, whose fold hex ids would
     match by chance).
   - `grams`: a marker of more than `window` - 2 tokens (report text, questions) as a group of its
     `GRAM_N`-token n-gram hashes; a text holding `GRAM_HITS` distinct n-grams of one group is a
     hit (an excerpt shorter than the window, or the text with every 5th word dropped).
   - `shingles` and `pieces`: near-duplicates and markers in pieces (`bat_jax.marker_fuzzy`).
5. Matching (`MarkerMatcher.find`): every string key and value of a row (ints and floats via
   `repr`) is scanned as is, in its decoded forms (`bat_jax.text_decoding`: URL, HTML, escapes,
   quoted-printable, base64/32/85, ascii85, hex) and, where it has leet characters inside words,
   leet-folded; the squashed/token junction of every two consecutive strings of the row is
   scanned too, the row's tokens are walked for marker pieces across any number of strings
   (with other text between), and n-gram groups and shingles are counted over the whole row.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bat_jax import marker_fuzzy
from bat_jax.marker_tables import (  # noqa: F401  (the public names of the scheme, re-exported)
  _JOIN,
  _TOKEN_RE,
  DEFAULT_WINDOW,
  GRAM_HITS,
  GRAM_N,
  JUNCTION_CHARS,
  JUNCTION_SPAN,
  MIN_MARKER_CHARS,
  SCHEME,
  SQUASH_MAX,
  SQUASH_MIN,
  _hasher,
  empty_export,
  export_digest,
  export_markers,
  normalize_tokens,
)
from bat_jax.text_decoding import decoded_variants
from bat_jax.text_normal import (
  LEET_MARK,
  has_leet,
  leet_fold,
  leet_marks,
  normalize_text,
)


@dataclasses.dataclass(frozen=True)
class MarkerHit:
  """One marker found in an object.

  Attributes:
    path: where it was found, JSONPath-like (`$.prompt[1].content`, `$.extra_info.<key>` for a
      key itself; `a + b` for a marker split across two consecutive strings; `$` for n-grams of
      one marker spread over several strings).
    in_key: True when the hit is in a dict key rather than a value.
    n_tokens: the length of the matching n-gram (squashed length for `kind="squashed"`).
    digest: the matched hash (never the plaintext).
    kind: "tokens", "squashed" or "ngrams" (which table of the export matched).
  """
  path: str
  in_key: bool
  n_tokens: int
  digest: str
  kind: str = "tokens"


@dataclasses.dataclass(frozen=True)
class _TextScan:
  """A memoised scan of one string: direct hits, matched n-grams, and its junction edges."""
  hits: tuple[tuple[str, int, str], ...]  # (kind, n, digest)
  grams: frozenset[str]
  head: tuple[tuple[str, ...], str]  # first tokens, first squashed chars
  tail: tuple[tuple[str, ...], str]  # last tokens, last squashed chars
  tokens: tuple[str, ...]  # of the string as is, for the piece walk
  starts: tuple[int, ...]  # indexes of `tokens` that are a marker prefix
  shingles: frozenset[str]


_UNSEEN = object()
_MEMO_LIMIT = 1_000_000  # bound memory on adversarially diverse input
# Hashed windows remembered (payload -> digest if an export table holds it); cleared when full.
_KNOWN_LIMIT = 500_000


class MarkerMatcher:
  """Finds hashed held-out markers in arbitrary nested JSON-like objects.

  Per-string results are memoised: rows of one round repeat most of their text (system prompt,
  stage instructions), so a round is scanned at the cost of its distinct strings.
  """

  def __init__(self, export: Mapping[str, Any]):
    # The scheme first: an older export lacks this version's tables, and its error should say
    # which versions differ, not which table is missing.
    if export.get("scheme") != SCHEME:
      raise ValueError(f"marker export scheme is {export.get('scheme')!r}, this matcher reads "
                       f"{SCHEME!r}: re-export the held-out markers with this version (an "
                       "older export lacks this version's tables; the leak check fails closed)")
    for key in ("salt_hex", "hashes", "squash", "anchors", "firsts", "grams", "shingles",
                "pieces"):
      if key not in export:
        raise ValueError(f"marker export is missing field {key!r}")
    try:
      salt = bytes.fromhex(export["salt_hex"])
    except (TypeError, ValueError) as e:
      raise ValueError(f"marker export field 'salt_hex' is not hex: {e}") from None
    self._base = _hasher(salt)
    self._hashes = self._length_table(export, "hashes")
    self._squash = self._length_table(export, "squash")
    self._anchors = {a: tuple(ls) for a, ls in export["anchors"].items()}
    self._longest_squash = max(self._squash, default=SQUASH_MIN)
    self._load_firsts(export["firsts"])
    grams = export["grams"]
    if int(grams.get("n", GRAM_N)) != GRAM_N:
      raise ValueError(f"marker export field 'grams.n' is {grams.get('n')!r}, not {GRAM_N}")
    self._gram_hits = int(grams.get("min_hits", GRAM_HITS))
    self._gram_groups: dict[str, list[int]] = {}
    for gid, group in enumerate(grams.get("groups", ())):
      for h in group:
        self._gram_groups.setdefault(h, []).append(gid)
    self._lengths = tuple(sorted(n for n, h in self._hashes.items() if h))
    self._edge = max(self._lengths + (GRAM_N,)) - 1
    self.digest = export_digest(export)
    self.marker_count = int(export.get("marker_count", 0))
    self._load_fuzzy(export["shingles"], export["pieces"])
    self._all_digests = frozenset().union(
        *self._hashes.values(), *self._squash.values(), self._anchors, self._gram_groups,
        self._vocab, self._shingle_groups, self._prefixes, self._firsts)
    self._known: dict[str, str | None] = {}
    # Squash windows hashed so far, and those of them that are anchors (-> squashed lengths).
    self._anchor_seen: dict[str, None] = {}
    self._anchor_windows: dict[str, tuple[int, ...]] = {}
    self._memo: dict[str, _TextScan] = {}
    self._junction_memo: dict[tuple, tuple[tuple[str, int, str], ...]] = {}
    self._piece_memo: dict[str, tuple] = {}

  def _load_fuzzy(self, shingles: Mapping[str, Any], pieces: Mapping[str, Any]) -> None:
    for field, table, value in (("span", shingles, marker_fuzzy.SHINGLE_SPAN),
                                ("gap_tokens", pieces, marker_fuzzy.GAP_TOKENS)):
      if table.get(field) != value:
        raise ValueError(f"marker export field {field!r} is {table.get(field)!r}, not {value}")
    self._shingle_containment = float(shingles["containment"])
    self._shingle_min_hits = int(shingles["min_hits"])
    self._vocab = frozenset(shingles["vocab"])
    self._shingle_groups: dict[str, list[int]] = {}
    self._shingle_sizes = []
    for gid, group in enumerate(shingles["groups"]):
      self._shingle_sizes.append(len(group))
      for h in group:
        self._shingle_groups.setdefault(h, []).append(gid)
    self._prefixes = frozenset(pieces["prefixes"])

  def _load_firsts(self, firsts: Any) -> None:
    if not isinstance(firsts, Mapping):
      raise ValueError("marker export field 'firsts' is not a table of lengths")
    self._gram_firsts = frozenset(firsts.get("gram", ()))
    self._firsts_by_n = self._length_table({"firsts": {k: v for k, v in firsts.items()
                                                       if k != "gram"}}, "firsts")
    self._firsts = self._gram_firsts.union(*self._firsts_by_n.values())

  @staticmethod
  def _length_table(export: Mapping[str, Any], field: str) -> dict[int, frozenset[str]]:
    table = {}
    for n, hashes in export[field].items():
      if not str(n).isdigit() or int(n) < 1:
        raise ValueError(f"marker export {field!r} key {n!r} is not a positive length")
      table[int(n)] = frozenset(hashes)
    return table

  def _digest_if_known(self, payload: str) -> str | None:
    """sha256(salt + payload) when some export table holds it, else None.

    Memoised: a round's texts (workspace scripts, specs, briefs) share most of their windows,
    so each distinct window is hashed once, not once per occurrence.
    """
    d = self._known.get(payload, _UNSEEN)
    if d is _UNSEEN:
      h = self._base.copy()
      h.update(payload.encode("utf-8"))
      d = h.hexdigest()
      d = d if d in self._all_digests else None
      if len(self._known) >= _KNOWN_LIMIT:
        self._known.clear()
      self._known[payload] = d
    return d

  def _digests(self, payloads: Iterable[str]) -> list[str | None]:
    """`_digest_if_known` of each payload, reading the memo inline (a scan's hot loop)."""
    payloads = payloads if isinstance(payloads, list) else list(payloads)
    out = list(map(self._known.get, payloads, itertools.repeat(_UNSEEN)))  # the memo read in C
    if _UNSEEN in out:
      compute = self._digest_if_known
      for i, d in enumerate(out):
        if d is _UNSEEN:
          out[i] = compute(payloads[i])
    return out

  def _token_hits(self, tokens: tuple[str, ...], token_digests: list, firsts: list[int],
                  out: list) -> None:
    """Token-window hits; `token_digests`: the digest of each token (its 1-token window);
    `firsts`: where a window of 2+ tokens can start (a token some exported window starts
    with): the early exit that keeps most of a text's windows unhashed."""
    for n in self._lengths:
      if n > 1 and not firsts:
        break  # `_lengths` ascend: no longer window can start anywhere
      table = self._hashes[n]
      if n > 1:
        starts = self._firsts_by_n.get(n, frozenset())
        digests = self._digests([_JOIN.join(tokens[j:j + n]) for j in firsts
                                 if j + n <= len(tokens) and token_digests[j] in starts])
      else:
        digests = token_digests
      for d in digests:
        if d is not None and d in table:
          out.append(("tokens", n, d))

  def _anchored(self, windows: list[str]) -> set[str]:
    """The windows (`SQUASH_MIN` chars each) whose hash is an anchor. Set operations do the
    per-position work in C: only windows never seen before are hashed, and a text with no
    anchor (nearly all) costs a few set passes."""
    seen = self._anchor_seen
    distinct = set(windows)
    new = distinct.difference(seen)
    if new:
      if len(seen) >= _KNOWN_LIMIT:
        seen.clear()
        self._anchor_windows.clear()
        new = distinct
      base, anchors = self._base, self._anchors
      for w in new:  # hashed inline: `_anchor_seen` is this table's memo, not `_known`
        h = base.copy()
        h.update(w.encode("utf-8"))
        d = h.hexdigest()
        seen[w] = None
        if d in anchors:
          self._anchor_windows[w] = anchors[d]
    return distinct.intersection(self._anchor_windows)

  def _squash_hits(self, squashed: str, starts: Sequence[int], out: list) -> None:
    if not self._anchors:
      return
    windows = [squashed[i:i + SQUASH_MIN] for i in starts]
    anchored = self._anchored(windows)
    if not anchored:
      return
    for i, w in zip(starts, windows):
      if w not in anchored:
        continue
      for n in self._anchor_windows[w]:
        if i + n <= len(squashed):
          d = self._digest_if_known(squashed[i:i + n])
          if d is not None and d in self._squash.get(n, ()):
            out.append(("squashed", n, d))

  def _grams(self, tokens: tuple[str, ...], token_digests: list, firsts: list[int]) -> set[str]:
    if not self._gram_groups or not firsts:
      return set()
    starts = self._gram_firsts
    windows = [_JOIN.join(tokens[j:j + GRAM_N]) for j in firsts
               if j + GRAM_N <= len(tokens) and token_digests[j] in starts]
    return {d for d in self._digests(windows) if d is not None and d in self._gram_groups}

  def _scan(self, text: str) -> _TextScan:
    cached = self._memo.get(text)
    if cached is not None:
      return cached
    hits: list = []
    grams: set = set()
    shingles: set = set()
    tokens, starts = (), ()
    for k, normal in enumerate(self._normal_forms(text)):
      var_tokens = tuple(_TOKEN_RE.findall(normal))
      tokens = var_tokens if k == 0 else tokens
      squashed = "".join(var_tokens)
      token_digests = self._digests(list(var_tokens))
      firsts = [j for j, d in enumerate(token_digests) if d is not None and d in self._firsts]
      self._token_hits(var_tokens, token_digests, firsts, hits)
      self._squash_hits(squashed, range(len(squashed) - SQUASH_MIN + 1), hits)
      if has_leet(normal):
        self._leet_hits(normal, hits)
      grams |= self._grams(var_tokens, token_digests, firsts)
      starts = starts if k else tuple(i for i, d in enumerate(token_digests)
                                      if d is not None and d in self._prefixes)
      if self._vocab:
        shingles |= marker_fuzzy.row_shingles(var_tokens, token_digests, self._digest_if_known,
                                              self._vocab, self._shingle_groups)
    squashed = "".join(tokens)
    edge = self._edge
    result = _TextScan(tuple(hits), frozenset(grams),
                       head=(tokens[:edge], squashed[:SQUASH_MAX - 1]),
                       tail=(tokens[-edge:] if edge else (), squashed[-JUNCTION_CHARS:]),
                       tokens=tokens, starts=starts, shingles=frozenset(shingles))
    if len(self._memo) < _MEMO_LIMIT:
      self._memo[text] = result
    return result

  @staticmethod
  def _normal_forms(text: str) -> Iterable[str]:
    """The normal forms one string is scanned in: as is first, then decoded."""
    for variant in (text, *decoded_variants(text)):
      yield normalize_text(variant)

  def _leet_hits(self, normal: str, out: list) -> None:
    """Markers in the leet fold of `normal`: squashed, looked for only where a window holds a
    leet character (elsewhere the fold adds nothing the plain scan has not matched), and as
    whole-token windows."""
    fold_tokens = tuple(_TOKEN_RE.findall(leet_fold(normal)))
    folded = "".join(fold_tokens)
    marks = "".join(_TOKEN_RE.findall(leet_marks(normal)))
    spans: list[list[int]] = []
    at = marks.find(LEET_MARK)
    longest = self._longest_squash
    while at >= 0:
      lo = max(0, at - longest + 1)
      if spans and lo <= spans[-1][1]:
        spans[-1][1] = at + 1
      else:
        spans.append([lo, at + 1])
      at = marks.find(LEET_MARK, at + 1)
    last = len(folded) - SQUASH_MIN + 1
    # All spans in one pass (one set of windows), not one pass per span.
    self._squash_hits(folded, [i for lo, hi in spans for i in range(lo, min(hi, last))], out)
    # Whole-token windows of the fold: a short or hex-like marker's fold is exported as tokens
    # only ("vst_4d75" -> "vst adts"), so "v57_4d75" is found here, never glued.
    token_digests = self._digests(list(fold_tokens))
    firsts = [j for j, d in enumerate(token_digests) if d is not None and d in self._firsts]
    self._token_hits(fold_tokens, token_digests, firsts, out)

  def _junction(self, tail, head) -> tuple[tuple[str, int, str], ...]:
    """Hits that straddle the boundary of two strings (the tail of one, the head of the next):
    only n-grams and squashed windows that start before the boundary and end after it."""
    key = (tail, head)
    cached = self._junction_memo.get(key)
    if cached is not None:
      return cached
    hits: list = []
    tokens, cut = tail[0] + head[0], len(tail[0])
    # A straddling window has 2+ tokens, so it starts with a token in `firsts` (as in `_scan`).
    lo = max(0, cut - self._edge)
    starts = [(j, d) for j, d in zip(range(lo, cut), self._digests(list(tokens[lo:cut])))
              if d is not None and d in self._firsts]
    for n in (self._lengths if starts else ()):
      table, firsts_n = self._hashes[n], self._firsts_by_n.get(n, frozenset())
      for d in self._digests([_JOIN.join(tokens[j:j + n]) for j, first in starts
                              if j > cut - n and j + n <= len(tokens) and first in firsts_n]):
        if d is not None and d in table:
          hits.append(("tokens", n, d))
    squashed = tail[1][-JUNCTION_CHARS:] + head[1]
    self._squash_hits(squashed, range(max(0, len(squashed) - len(head[1]) - JUNCTION_CHARS),
                                      len(squashed) - len(head[1])), hits)
    if self._gram_groups and starts:
      for d in self._digests([_JOIN.join(tokens[j:j + GRAM_N]) for j, first in starts
                              if j > cut - GRAM_N and j + GRAM_N <= len(tokens)
                              and first in self._gram_firsts]):
        if d is not None and d in self._gram_groups:
          hits.append(("gram", 0, d))
    result = tuple(hits)
    if len(self._junction_memo) < _MEMO_LIMIT:
      self._junction_memo[key] = result
    return result

  def find(self, obj: Any) -> list[MarkerHit]:
    """All marker hits in `obj`: every key and value, across nearby string values, n-grams.

    A split marker is looked for across each string value and the next `JUNCTION_SPAN` values
    (so a role or flag between two message halves does not hide it)."""
    leaves: list[tuple[str, bool, str]] = []
    _leaves(obj, "$", leaves)
    hits: list[MarkerHit] = []
    gram_paths: dict[str, set[str]] = {}
    recent: list[tuple[str, _TextScan]] = []
    pieces = marker_fuzzy.PieceScan(self._digest_if_known, self._prefixes,
                                    self._is_squashed_marker)
    shingles: set[str] = set()
    for path, in_key, text in leaves:
      scan = self._scan(text)
      hits.extend(MarkerHit(path, in_key, n, d, kind) for kind, n, d in scan.hits)
      for g in scan.grams:
        gram_paths.setdefault(g, set()).add(path)
      if in_key:
        continue
      for prev_path, prev in recent:
        where = f"{prev_path} + {path}"
        for kind, n, d in self._junction(prev.tail, scan.head):
          if kind == "gram":
            gram_paths.setdefault(d, set()).add(where)
          else:
            hits.append(MarkerHit(where, False, n, d, kind))
      recent = (recent + [(path, scan)])[-JUNCTION_SPAN:]
      if len(self._piece_memo) >= _MEMO_LIMIT:
        self._piece_memo.clear()
      pieces.feed(scan.tokens, scan.starts, self._piece_memo, text)
      shingles |= scan.shingles
    hits.extend(self._group_hits(gram_paths))
    hits.extend(MarkerHit("$", False, n, d, "pieces") for n, d in pieces.hits)
    hits.extend(self._shingle_hits(shingles))
    return hits

  def _is_squashed_marker(self, joined: str, digest: str) -> bool:
    return digest in self._squash.get(len(joined), ())

  def _shingle_hits(self, found: set[str]) -> list[MarkerHit]:
    """One hit per long marker of which the row holds enough skip-pair shingles."""
    counts: dict[int, int] = {}
    for h in found:
      for gid in self._shingle_groups[h]:
        counts[gid] = counts.get(gid, 0) + 1
    return [MarkerHit("$", False, marker_fuzzy.SHINGLE_SPAN, f"shingles:{gid}", "shingles")
            for gid, c in sorted(counts.items())
            if c >= max(self._shingle_min_hits,
                        self._shingle_containment * self._shingle_sizes[gid])]

  def _group_hits(self, gram_paths: Mapping[str, set[str]]) -> list[MarkerHit]:
    """One hit per long marker of which the row holds >= `min_hits` distinct n-grams."""
    by_group: dict[int, list[str]] = {}
    for g in gram_paths:
      for gid in self._gram_groups[g]:
        by_group.setdefault(gid, []).append(g)
    hits = []
    for gid, grams in sorted(by_group.items()):
      if len(grams) >= self._gram_hits:
        paths = set().union(*(gram_paths[g] for g in grams))
        path = paths.pop() if len(paths) == 1 else "$"
        hits.append(MarkerHit(path, False, GRAM_N, min(grams), "ngrams"))
    return hits


def _leaves(obj: Any, path: str, out: list[tuple[str, bool, str]]) -> None:
  """(path, in_key, text) of every string key and value of `obj`, in order."""
  if isinstance(obj, Mapping):
    for key, value in obj.items():
      child = f"{path}.{key}"
      out.append((child, True, str(key)))
      _leaves(value, child, out)
  elif isinstance(obj, (list, tuple)):
    for i, value in enumerate(obj):
      _leaves(value, f"{path}[{i}]", out)
  elif isinstance(obj, str):
    out.append((path, False, obj))
  elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
    out.append((path, False, repr(obj)))
