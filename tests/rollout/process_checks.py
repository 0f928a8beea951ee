"""Process checks of the launcher tests: is a killed server's whole process group gone?"""

from __future__ import annotations

import os
from pathlib import Path


def group_alive(pgid: int) -> bool:
  """Whether a live (non-zombie) process of group `pgid` still exists.

  Zombies are excluded: in containers whose PID 1 does not reap, a killed grandchild stays a
  zombie forever although it holds no resources.
  """
  proc = Path("/proc")
  if not proc.is_dir():  # not Linux: fall back to signal 0 (counts zombies)
    try:
      os.killpg(pgid, 0)
    except ProcessLookupError:
      return False
    return True
  for stat in proc.glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
      continue  # exited while we looked
    state, pgrp = fields[0], int(fields[2])
    if pgrp == pgid and state != "Z":
      return True
  return False
