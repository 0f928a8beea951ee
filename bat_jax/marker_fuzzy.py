"""The marker forms that exact hashing misses: near-duplicates and pieces with text between.

Both work on salted hashes only, like the rest of `bat_jax.markers` (`digest` below is the
matcher's memoised `sha256(salt + payload)` that returns None unless an export table holds it).

- Near-duplicates (`shingles`): a long held-out text (>= `SHINGLE_MIN_TOKENS` content tokens:
  those of `SHINGLE_MIN_CHARS` or more) is exported as its set of word skip-pairs: every
  unordered pair of content tokens at most `SHINGLE_SPAN` apart, minus the pairs public text
  makes too. A row whose strings hold
  `SHINGLE_CONTAINMENT` of one marker's pairs (and at least `SHINGLE_MIN_HITS`) is a hit: the
  text with words dropped, swapped, or reordered nearby. Unordered pairs survive a swap; pairs
  up to 3 apart survive dropped words. The export also holds the hashed vocabulary of these
  texts so a scan pairs only tokens that can be in some pair.
- Pieces (`pieces`): a marker of `SQUASH_MIN..SQUASH_MAX` squashed characters is exported as
  the hashes of its squashed prefixes. `PieceScan` walks the row's tokens across all its string
  values: a token that is a prefix starts a partial marker, a later token extends it when the
  result is still a prefix (or completes the marker), and a partial of `MIN_GAP_PREFIX` or more
  characters waits up to `GAP_TOKENS` tokens for its continuation, so a marker cut into any
  number of messages or fields, or with other text between its pieces, is found.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

SHINGLE_MIN_TOKENS = 8
SHINGLE_MIN_CHARS = 4  # shorter tokens (a, of, the, 25, px) are left out of the pairs
SHINGLE_SPAN = 4
SHINGLE_CONTAINMENT = 0.2  # every 3rd word dropped keeps 27-37% of a report's pairs
SHINGLE_MIN_HITS = 5
PAIR_JOIN = "\x1e"
GAP_TOKENS = 12
MIN_GAP_PREFIX = 2
MAX_PARTIALS = 12

Digest = Callable[[str], "str | None"]


def pair_payload(a: str, b: str) -> str:
  return PAIR_JOIN.join((a, b) if a <= b else (b, a))


def content(tokens: Sequence[str]) -> list[str]:
  return [t for t in tokens if len(t) >= SHINGLE_MIN_CHARS]


def skip_pairs(tokens: Sequence[str]) -> set[tuple[str, str]]:
  """Unordered pairs of distinct content tokens at most `SHINGLE_SPAN` apart."""
  tokens = content(tokens)
  out = set()
  for i, a in enumerate(tokens):
    for b in tokens[i + 1:i + 1 + SHINGLE_SPAN]:
      if a != b:
        out.add((a, b) if a <= b else (b, a))
  return out


def public_pairs(grams: Iterable[tuple[str, ...]]) -> frozenset[tuple[str, str]]:
  """The skip-pairs public text makes (from its `SHINGLE_SPAN` + 1-token n-grams)."""
  found: set[tuple[str, str]] = set()
  for g in grams:
    found |= skip_pairs(g)
  return frozenset(found)


def shingle_group(tokens: Sequence[str], public: frozenset) -> set[tuple[str, str]]:
  """The skip-pairs a long marker is exported as (empty when too short or too public)."""
  if len(content(tokens)) < SHINGLE_MIN_TOKENS:
    return set()
  pairs = skip_pairs(tokens) - public
  return pairs if len(pairs) >= SHINGLE_MIN_HITS else set()


def prefixes(squashed: str) -> list[str]:
  """Every squashed prefix of a marker, of >= 2 chars."""
  return [squashed[:k] for k in range(2, len(squashed))]


def row_shingles(tokens: Sequence[str], token_digests: Sequence[str | None], digest: Digest,
                 vocab: frozenset, groups: dict) -> set[str]:
  """The exported shingle hashes among `tokens`' skip-pairs (`token_digests`: each token's)."""
  kept = [(t, d) for t, d in zip(tokens, token_digests) if len(t) >= SHINGLE_MIN_CHARS]
  tokens = [t for t, _ in kept]
  in_vocab = [d is not None and d in vocab for _, d in kept]
  found = set()
  for i, a in enumerate(tokens):
    if not in_vocab[i]:
      continue
    for j in range(i + 1, min(i + 1 + SHINGLE_SPAN, len(tokens))):
      if in_vocab[j] and tokens[j] != a:
        d = digest(pair_payload(a, tokens[j]))
        if d is not None and d in groups:
          found.add(d)
  return found


class PieceScan:
  """The partial-marker walk over one row's tokens (see the module docstring)."""

  def __init__(self, digest: Digest, every: frozenset, complete: Callable[[str, str], bool]):
    self._digest, self._every, self._complete = digest, every, complete
    self.partials: list[list] = []  # [squashed so far, tokens waited since]
    self.hits: list[tuple[int, str]] = []  # (squashed length, digest)

  def feed(self, tokens: Sequence[str], starts: Sequence[int], memo: dict, key: str) -> None:
    """Walks `tokens` (one string's); `starts`: the indexes of tokens that are prefixes.

    A string entered with no partial marker waiting always leaves the same hits and partials:
    `memo` (kept by the caller across rows, under `key`: the string, whose hash Python caches)
    holds them, so text every row repeats (system prompts, stage instructions) is walked once."""
    if not starts and not self.partials:
      return
    if self.partials:
      self._walk(tokens, starts)
      return
    cached = memo.get(key)
    if cached is None:
      earlier, self.hits = self.hits, []
      self._walk(tokens, starts)
      cached = memo[key] = (tuple(self.hits), tuple(tuple(p) for p in self.partials))
      self.hits = earlier
    self.hits.extend(cached[0])
    self.partials = [list(p) for p in cached[1]]

  def _walk(self, tokens: Sequence[str], starts: Sequence[int]) -> None:
    starts = sorted(starts, reverse=True)  # a stack: the next start last
    i = 0
    while i < len(tokens):
      if not self.partials:  # nothing waits: jump to the next token that starts a marker
        if not starts:
          return
        i = starts[-1]
      while starts and starts[-1] < i:
        starts.pop()
      is_start = bool(starts) and starts[-1] == i
      self._step(tokens[i], is_start)
      i += 1

  def _step(self, tok: str, is_start: bool) -> None:
    grown: list[list] = []
    for partial in self.partials:
      partial[1] += 1
      joined = partial[0] + tok
      if len(tok) > 1:  # its first character must continue a prefix (a memo hit, mostly)
        head = self._digest(partial[0] + tok[0])
        if head is None or head not in self._every:
          continue
      d = self._digest(joined)
      if d is not None and self._complete(joined, d):
        self.hits.append((len(joined), d))
      if d is not None and d in self._every:
        grown.append([joined, 0])
    if is_start:
      grown.append([tok, 0])
    kept = [p for p in self.partials if p[1] <= GAP_TOKENS and len(p[0]) >= MIN_GAP_PREFIX]
    self.partials = (kept + grown)[-MAX_PARTIALS:]
