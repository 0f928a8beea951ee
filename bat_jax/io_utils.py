"""Atomic, durable file writes: tmp file + fsync + rename, then fsync of the folder.

A reader sees either the old file or the complete new one, never a partial write, and after the
call returns the new content survives a crash. One helper for the whole package; only the code
shipped INTO sandbox workspaces (`bat_jax/taskkit/scripts/`) keeps its own stdlib copy, because
it must run on a bare system python without this package.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Union

PathLike = Union[str, os.PathLike]


def fsync_dir(path: PathLike) -> None:
  """fsyncs a folder, so a rename or a new entry in it is durable."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def fsync_file(path: PathLike) -> None:
  """fsyncs a file written by someone else (e.g. a library writer that does not)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def fsync_tree(root: PathLike) -> None:
  """fsyncs every file under `root`, then `root` itself, so a rename publishes durable data."""
  root = Path(root)
  for file in sorted(p for p in root.rglob("*") if p.is_file()):
    fsync_file(file)
  fsync_dir(root)


def atomic_write_bytes(path: PathLike, data: bytes, *, sync_dir: bool = True,
                       durable: bool = True) -> Path:
  """Writes `data` to `path` atomically, creating parent folders; returns the path.

  The tmp file sits beside `path` (same filesystem, so the rename is atomic), is created with
  O_EXCL | O_NOFOLLOW (never writes through a pre-planted file or link) and the mode a plain
  `open` would give, and is removed if anything fails.

  Args:
    path: the destination; a link there is replaced, never written through.
    data: the new content.
    sync_dir: also fsync the folder so the rename itself survives a crash (skip it for scratch
      files written in bulk, e.g. a sandbox workspace).
    durable: False skips every fsync (still atomic, not crash-safe: transient files a crash
      simply rewrites, e.g. the per-step rollout weight sync).
  """
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      if durable:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # replaces a link at `path` itself; never writes through it
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  if sync_dir and durable:
    fsync_dir(path.parent)
  return path


def atomic_write_text(path: PathLike, text: str) -> Path:
  """`atomic_write_bytes` of UTF-8 text."""
  return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: PathLike, obj: Any) -> Path:
  """`atomic_write_text` of `obj` as JSON (indent 1, sorted keys, trailing newline)."""
  return atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")
