"""The decoded forms a string can hide text behind: URL-encoding, HTML entities, base64, hex.

Used by the held-out marker matcher (`bat_jax.markers`), which scans a string as is and in
each of these forms.
"""

from __future__ import annotations

import base64
import binascii
import html
import re
import urllib.parse
from typing import Iterator

_B64_RE = re.compile(r"[A-Za-z0-9+/_\-]{8,}={0,2}")
_HEX_RE = re.compile(r"(?:[0-9A-Fa-f]{2}){6,}")
_MAX_DECODE_DEPTH = 2


def decoded_variants(text: str, depth: int = _MAX_DECODE_DEPTH) -> Iterator[str]:
  """`text` decoded from URL-encoding, HTML entities and base64 / hex runs (not `text` itself)."""
  if depth <= 0:
    return
  found = []
  if "%" in text:
    found.append(urllib.parse.unquote(text, errors="replace"))
  if "&" in text:
    found.append(html.unescape(text))
  for m in _B64_RE.finditer(text):
    run = m.group(0)
    for altchars in (b"+/", b"-_"):
      try:
        raw = base64.b64decode(run.rstrip("=") + "=" * (-len(run.rstrip("=")) % 4),
                               altchars=altchars)
      except (binascii.Error, ValueError):
        continue
      found.append(raw.decode("utf-8", errors="ignore"))
  for m in _HEX_RE.finditer(text):
    found.append(bytes.fromhex(m.group(0)).decode("utf-8", errors="ignore"))
  for variant in found:
    if variant and variant != text:
      yield variant
      yield from decoded_variants(variant, depth - 1)
