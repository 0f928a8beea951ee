"""The machine that built a tiny base, recorded beside it (never in its cache key).

Why: the same config, seed and rows have built bases that copy 0.71 on one box and 0.43 on two
others (experiments/README.md, "A third box"), and nothing in the record said what set the first
box apart. The CPU's vector extensions and the XLA build decide the floating point of a step.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

# Extensions that change how XLA:CPU vectorises a step's loops and dots.
ISA_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "avx2", "fma", "neon", "asimd")


def _cpuinfo(path: Path) -> tuple[str, set[str]]:
  """(model name, flags) from a Linux /proc/cpuinfo; ("", empty) where there is none."""
  try:
    text = path.read_text()
  except OSError:
    return "", set()
  model, flags = "", set()
  for line in text.splitlines():
    key, _, value = line.partition(":")
    key = key.strip()
    if key == "model name" and not model:
      model = value.strip()
    elif key in ("flags", "Features") and not flags:
      flags = set(value.split())
  return model, flags


def _version(package: str) -> str:
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return ""


def host_record(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
  """What the report shows as the base's builder: CPU, its vector extensions, core count,
  the jax / jaxlib versions and XLA_FLAGS."""
  model, flags = _cpuinfo(cpuinfo)
  return {"machine": platform.machine(), "cpu": model or platform.processor(),
          "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count(),
          "jax": _version("jax"), "jaxlib": _version("jaxlib"),
          "xla_flags": os.environ.get("XLA_FLAGS", "")}
