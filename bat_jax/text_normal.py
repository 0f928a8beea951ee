"""The normal form held-out markers are hashed and matched in, and the folds built on it.

`normalize_text`: NFKD; drop format characters (Unicode Cf: zero-width space and joiners, bidi
marks), combining marks and every Default_Ignorable_Code_Point (the Hangul fillers U+115F,
U+1160, U+3164, U+FFA0, variation selectors, tag characters); NFKC; map each look-alike to the
prototype the Unicode confusables data (UTS #39 `confusables.txt`, through the
`confusable_homoglyphs` package) gives it, when that prototype is ASCII alphanumeric (a
look-alike digit of another script maps to its digit); casefold; map again (casefold can make a
new look-alike: Greek "Μ" folds to "μ").

Folds of a normal form, for the encodings a marker is hashed in (see `bat_jax.markers`):
`caesar` (a letter shift, rot13 is 13) and `leet_fold` (digits and symbols standing for
letters: "h3ld-0ut" and "heldout" fold alike).
"""

from __future__ import annotations

import functools
import re
import string
import sys
import unicodedata

from confusable_homoglyphs import confusables as _uts39

# Default_Ignorable_Code_Point, Unicode 15.1 DerivedCoreProperties.txt (the ranges that are not
# already Cf): invisible letters a policy could spell a marker with, or hide one behind.
_DEFAULT_IGNORABLE = (
    (0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F), (0x2065, 0x2065),
    (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
    (0xE0000, 0xE0FFF))
_DROP_CATEGORIES = frozenset({"Cf", "Mn", "Me"})
_BIDI_MARKS = "\u200e\u200f\u061c"  # the data file wraps right-to-left prototypes in these
_LEET = str.maketrans({"0": "o", "1": "l", "i": "l", "!": "l", "|": "l", "3": "e", "4": "a",
                       "@": "a", "5": "s", "$": "s", "7": "t", "+": "t", "8": "b", "6": "g",
                       "9": "g", "2": "z"})
# `leet_marks`: each leet character as one letter that nothing else normalises to (so the
# squashed forms of `leet_fold` and `leet_marks` align position by position).
_LEET_MARK = "\u0298"
_LEET_MARKS = str.maketrans({c: _LEET_MARK for c in "0123456789@$!|+"})
# A leet character next to a letter ("c4se", "c453", "c@se", "1mage"): only text that has one
# is scanned folded too.
_LEET_IN_WORD_RE = re.compile(r"[0-9@$!|+][^\W\d_]|[^\W\d_][0-9@$!|+]")
_I_NAME_RE = re.compile(r"\b(?:I|IOTA)\b")
_LOWER = string.ascii_lowercase
_CAESAR = tuple(str.maketrans(_LOWER, _LOWER[k:] + _LOWER[:k]) for k in range(26))


@functools.cache
def _drop_table() -> dict[int, None]:
  """Every code point `normalize_text` deletes (built once, on the first non-ASCII text)."""
  drop = {cp: None for lo, hi in _DEFAULT_IGNORABLE for cp in range(lo, hi + 1)}
  for cp in range(0x80, sys.maxunicode + 1):
    if unicodedata.category(chr(cp)) in _DROP_CATEGORIES:
      drop[cp] = None
  return drop


def _prototype(char: str, entries: list[dict]) -> str | None:
  digit = unicodedata.decimal(char, None)
  if digit is not None:
    return str(digit)
  for entry in entries:
    proto = entry["c"].strip(_BIDI_MARKS)
    if proto.isascii() and proto.isalnum():
      # UTS #39 makes "l" the prototype of I too; markers are casefolded, so an I look-alike
      # ("GREEK CAPITAL LETTER IOTA", "LISU LETTER I") must become the i it spells.
      if proto == "l" and _I_NAME_RE.search(unicodedata.name(char, "")):
        return "i"
      return proto
  return None


@functools.cache
def confusable_table() -> dict[int, str]:
  """Non-ASCII look-alike -> its ASCII prototype, from the UTS #39 confusables data.

  The package stores each confusable pair in both directions; a character whose list holds an
  ASCII letter or digit is mapped to it (the data's prototypes are fixed points, so a source
  character lists its prototype and a prototype lists only its sources)."""
  table = {}
  for char, entries in _uts39.confusables_data.items():
    if len(char) == 1 and not char.isascii():
      proto = _prototype(char, entries)
      if proto is not None:
        table[ord(char)] = proto
  return table


def normalize_text(text: str) -> str:
  """The normal form every marker hash is built from (see the module docstring)."""
  if text.isascii():
    return text.casefold()
  text = unicodedata.normalize("NFKD", text).translate(_drop_table())
  table = confusable_table()
  text = unicodedata.normalize("NFKC", text).translate(table)
  return text.casefold().translate(table)


def leet_fold(normal: str) -> str:
  """`normal` with leet digits and symbols read as letters (and `i` as `l`, as `1` is both)."""
  return normal.translate(_LEET)


def leet_marks(normal: str) -> str:
  """`normal` with every leet character replaced by `LEET_MARK` (where a leet match must lie)."""
  return normal.translate(_LEET_MARKS)


LEET_MARK = _LEET_MARK


def has_leet(normal: str) -> bool:
  """True when `normal` has a leet character inside a word: only then is it scanned folded."""
  return _LEET_IN_WORD_RE.search(normal) is not None


def caesar(normal: str, shift: int) -> str:
  """`normal` with every ASCII letter shifted by `shift` (digits and the rest unchanged)."""
  return normal.translate(_CAESAR[shift % 26])
