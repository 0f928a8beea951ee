"""The decoded forms a string can hide text behind.

URL-encoding, HTML entities, `\\uXXXX` / `\\UXXXXXXXX` / `\\xNN` escapes, quoted-printable `=NN`,
and base64, base32, base85 (RFC 1924 / git) and ascii85 (Adobe `<~..~>` or bare) runs, and hex
runs. Used by the held-out marker matcher (`bat_jax.markers`), which scans a string as is and in
each of these forms. A decoded run that is not UTF-8 or not mostly printable text is dropped:
it hides no marker and would only cost scanning.
"""

from __future__ import annotations

import base64
import binascii
import functools
import html
import re
import urllib.parse
from collections.abc import Iterator

_B64_RE = re.compile(r"[A-Za-z0-9+/_\-]{8,}={0,2}")
# The run patterns start a match only where no letter of the run precedes it and take the
# letters before the required digit or symbol possessively (`*+`): the same matches as the plain
# `[run]*[required][run]*`, without its quadratic retries inside every word that lacks one.
_B32_RE = re.compile(r"[A-Z2-7]{8,}=*|(?<![a-z])[a-z]*+[2-7][a-z2-7]*={0,6}")
_HEX_RE = re.compile(r"(?:[0-9A-Fa-f]{2}){6,}")
_B85_CHARS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~"
# Runs of 5+ chars (4 bytes) that hold a symbol (a run of letters and digits is a word, not
# decoded: base85 of a marker avoids all 23 symbols with chance (62/85)^L, 4% at 10 chars,
# 0.9% at 15, 0.2% at 20; ascii85 its 28 with (57/85)^L, 1.8% at 10). A run shaped like an
# identifier, a path or a number (`_WORDISH_RE`) is not decoded either.
_B85_SET = "[" + re.escape(_B85_CHARS) + "]"
_B85_RE = re.compile(f"(?<![0-9A-Za-z])[0-9A-Za-z]*+[!#$%&()*+\\-;<=>?@^_`{{|}}~]{_B85_SET}*")
_A85_RE = re.compile(r"<~([!-uz\s]+)~>|(?<![0-9A-Za-uz])[0-9A-Za-uz]*+[!-/:-@\[-`][!-uz]*")
_WORDISH_RE = re.compile(r"[a-z0-9_\-./:]+|[A-Za-z]+[0-9]*|[A-Z0-9_]+|[0-9.,:;eE+\-]+")
_ESCAPE_RE = re.compile(r"\\u[0-9A-Fa-f]{4}|\\U[0-9A-Fa-f]{8}|(?:\\x[0-9A-Fa-f]{2})+")
_QP_RE = re.compile(r"(?:=[0-9A-Fa-f]{2})+")
_B85_VALUE = {c: i for i, c in enumerate(_B85_CHARS)}
_MAX_DECODE_DEPTH = 2
_MIN_TEXT_CHARS = 4
_MIN_PRINTABLE = 0.8
_MAX_INVALID = 0.1  # of a run's bytes
_RUN_MEMO = 1 << 16  # distinct runs remembered per kind


def _text_of(raw: bytes) -> str:
  """`raw` as UTF-8 text, or "" when it is too short, not UTF-8 or mostly not printable.

  Words and identifiers read as base64/85 decode to near-random bytes, 10-70% of them invalid
  UTF-8 (measured over a round's rows and workspaces); encoded text has none, so a run with
  more than `_MAX_INVALID` invalid bytes is not text (a few, planted to break a strict decode,
  are dropped and the rest scanned)."""
  text = raw.decode("utf-8", errors="replace")
  invalid = text.count("\ufffd")
  if invalid > _MAX_INVALID * len(raw):
    return ""
  text = text.replace("\ufffd", "") if invalid else text
  if len(text) < _MIN_TEXT_CHARS:
    return ""
  if text.isprintable():
    return text
  printable = sum(c.isprintable() or c.isspace() for c in text)
  return text if printable >= _MIN_PRINTABLE * len(text) else ""


def _ascii_text(head: bytes) -> bool:
  """Whether the first decoded bytes of a run are printable ASCII: the cheap test that skips
  decoding the rest of a run that was never an encoding (most runs fail it in 4 bytes; a
  marker that starts with non-ASCII letters is not looked for in base32/85)."""
  return bool(head) and all(32 <= b < 127 or b in (9, 10, 13) for b in head)


def _base85(run: str, values: dict[str, int] | None) -> bytes:
  """Decodes base85 (`values`: the RFC 1924 digits) or ascii85 (`values` None: `!` is 0,
  `z` already expanded)."""
  digits = [values[c] for c in run] if values is not None else [ord(c) - 33 for c in run]
  pad = -len(digits) % 5
  digits += [84] * pad
  out = bytearray()
  for i in range(0, len(digits), 5):
    a, b, c, d, e = digits[i:i + 5]
    word = (((a * 85 + b) * 85 + c) * 85 + d) * 85 + e
    if word > 0xFFFFFFFF:
      return b""
    out += word.to_bytes(4, "big")
  return bytes(out[:len(out) - pad])


def _unescape(text: str) -> str:
  def one(m: re.Match) -> str:
    s = m.group(0)
    if s[1] == "x":
      raw = bytes(int(s[i + 2:i + 4], 16) for i in range(0, len(s), 4))
      try:
        return raw.decode("utf-8")
      except UnicodeDecodeError:
        return raw.decode("latin-1")
    code = int(s[2:], 16)
    return chr(code) if code <= 0x10FFFF else s
  out = _ESCAPE_RE.sub(one, text)
  # Escaped surrogate pairs ("\\ud83d\\ude00") become the character they encode.
  return out.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _quoted_printable(text: str) -> str:
  text = re.sub(r"=\r?\n", "", text)
  return _QP_RE.sub(lambda m: bytes.fromhex(m.group(0).replace("=", "")).decode(
      "utf-8", errors="replace"), text)


def _runs(text: str) -> Iterator[str]:
  """Text decoded from every base64 / base32 / base85 / ascii85 / hex run of `text`."""
  for m in _B64_RE.finditer(text):
    yield from _b64_run(m.group(0))
  for m in _B32_RE.finditer(text):
    yield _b32_run(m.group(0))
  for m in _B85_RE.finditer(text):
    yield _b85_run(m.group(0))
  for m in _A85_RE.finditer(text):
    yield _a85_run(m.group(0), m.group(1))
  for m in _HEX_RE.finditer(text):
    yield _text_of(bytes.fromhex(m.group(0)))


# One decode per distinct run: the texts of a round (workspace scripts above all) repeat most
# of their runs (identifiers, calls, paths), and a run decodes the same in every text.
@functools.lru_cache(maxsize=_RUN_MEMO)
def _b64_run(match: str) -> tuple[str, ...]:
  run = match.rstrip("=")
  # The two alphabets differ only in `+/` vs `-_`: a run with neither decodes alike.
  alphabets = (b"+/", b"-_") if any(c in run for c in "+/-_") else (b"+/",)
  out = []
  for altchars in alphabets:
    try:
      out.append(_text_of(base64.b64decode(run + "=" * (-len(run) % 4), altchars=altchars)))
    except (binascii.Error, ValueError):
      continue
  return tuple(out)


@functools.lru_cache(maxsize=_RUN_MEMO)
def _b32_run(match: str) -> str:
  run = match.rstrip("=").upper()
  try:
    if len(run) >= 8 and _ascii_text(base64.b32decode(run[:8])):
      return _text_of(base64.b32decode(run + "=" * (-len(run) % 8)))
  except (binascii.Error, ValueError):
    pass
  return ""


@functools.lru_cache(maxsize=_RUN_MEMO)
def _b85_run(run: str) -> str:
  if len(run) >= 5 and not _WORDISH_RE.fullmatch(run) and _ascii_text(_base85(run[:5], _B85_VALUE)):
    return _text_of(_base85(run, _B85_VALUE))
  return ""


@functools.lru_cache(maxsize=_RUN_MEMO)
def _a85_run(match: str, framed: str | None) -> str:
  run = re.sub(r"\s", "", framed) if framed is not None else match
  run = run.replace("z", "!!!!!")
  if ((framed is not None or (len(run) >= 5 and not _WORDISH_RE.fullmatch(run)))
      and _ascii_text(_base85(run[:5], None))):
    return _text_of(_base85(run, None))
  return ""


def decoded_variants(text: str, depth: int = _MAX_DECODE_DEPTH) -> Iterator[str]:
  """`text` decoded from each encoding of the module docstring (not `text` itself)."""
  if depth <= 0:
    return
  found = []
  if "%" in text:
    found.append(urllib.parse.unquote(text, errors="replace"))
  if "&" in text:
    found.append(html.unescape(text))
  if "\\" in text:
    found.append(_unescape(text))
  if "=" in text:
    found.append(_quoted_printable(text))
  found.extend(_runs(text))
  for variant in dict.fromkeys(found):
    if variant and variant != text:
      yield variant
      yield from decoded_variants(variant, depth - 1)
