"""Assembles stdlib-only package code into standalone scripts for a task workspace.

Lines ending in `# inlined` (package-internal imports) are dropped unless `rewrite` maps them
to something else (e.g. an import of a sibling file), and the modules are concatenated,
dependencies first, so the result runs on a bare system python.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Mapping

_FUTURE = "from __future__ import annotations"


@functools.cache
def _source(obj: object) -> str:
  return inspect.getsource(obj)


def inline_source(*parts: object, rewrite: Mapping[str, str] = {},
                  replace: tuple[tuple[str, str], ...] = ()) -> str:
  """One script from modules / functions `parts` (dependencies first).

  Args:
    parts: modules or functions, concatenated in order.
    rewrite: exact stripped source line -> replacement line (applied before dropping).
    replace: (old, new) substrings replaced in the result; each must occur.
  """
  lines = [_FUTURE]
  for part in parts:
    for line in _source(part).splitlines():
      line = rewrite.get(line.strip(), line)
      if line.rstrip().endswith("# inlined") or line.strip() == _FUTURE:
        continue
      lines.append(line)
    lines.append("")
  text = "\n".join(lines)
  for old, new in replace:
    if old not in text:
      raise ValueError(f"{old!r} not found while inlining {[p.__name__ for p in parts]}")
    text = text.replace(old, new)
  return text


def function_sources(*functions: Callable) -> str:
  """Source text of some functions, for a script that needs only those."""
  return "\n\n".join(_source(f) for f in functions)
