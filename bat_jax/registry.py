"""Name -> implementation registries (schedules, remat policies, loss options, advantage modes).

Each registry is a plain mapping beside what it registers; `check_registered` is the one check that
a configured name is in it, so every registry rejects a bad name with the same message.
"""

from __future__ import annotations

from typing import Mapping


def check_registered(kind: str, name: str, registry: Mapping[str, object]) -> None:
  """Raises a ValueError naming `kind` and listing the valid names when `name` is unknown."""
  if name not in registry:
    raise ValueError(f"unknown {kind} {name!r}; valid: {sorted(registry)}")
