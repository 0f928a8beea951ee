"""Host-side workspace helpers: fingerprint, diff, size, ownership and materialise.

None of these ever follow a symlink: the agent can plant links that point anywhere on the host,
so a link is fingerprinted by its target *string* and never opened, and `materialize` refuses to
write through one.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Iterator, Mapping, Optional

from bat_jax import io_utils

_CHUNK = 1 << 20
# Domain-separates a symlink's fingerprint from a regular file holding the same bytes.
_SYMLINK_PREFIX = b"symlink\0"


def _walk(root: Path, rel: str = "") -> Iterator[tuple[str, os.DirEntry]]:
  """Yields (relpath, entry) for every non-directory entry under root, never following links."""
  with os.scandir(root / rel if rel else root) as it:
    entries = sorted(it, key=lambda e: e.name)
  for entry in entries:
    child = f"{rel}/{entry.name}" if rel else entry.name
    if entry.is_dir(follow_symlinks=False):
      yield from _walk(root, child)
    else:
      yield child, entry


def _file_sha256(path: str) -> str:
  # O_NOFOLLOW: a file swapped for a link between scandir and open is refused, not followed.
  fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
  h = hashlib.sha256()
  with os.fdopen(fd, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _entry_sha256(entry: os.DirEntry) -> Optional[str]:
  """sha256 of a regular file's bytes, or of a symlink's target string; None for others."""
  if entry.is_symlink():
    return hashlib.sha256(_SYMLINK_PREFIX + os.fsencode(os.readlink(entry.path))).hexdigest()
  if entry.is_file(follow_symlinks=False):
    return _file_sha256(entry.path)
  return None  # fifo, socket, device: not content the rubric can read


def fingerprint(workspace: Path) -> dict[str, str]:
  """{relpath: sha256} of every file (and symlink, by target) under workspace, sorted.

  Relpaths use "/" separators. Directories are implied by their files. Symlinks are never
  followed, so a link to a host file fingerprints the link, not the host file.
  """
  workspace = Path(workspace)
  if not workspace.is_dir():
    raise FileNotFoundError(f"workspace {str(workspace)!r} is not a directory")
  fp = {}
  for rel, entry in _walk(workspace):
    digest = _entry_sha256(entry)
    if digest is not None:
      fp[rel] = digest
  return fp


def fingerprint_digest(fp: Mapping[str, str]) -> str:
  """One sha256 over a fingerprint (order-independent), e.g. to compare workspaces."""
  canon = json.dumps(dict(sorted(fp.items())), separators=(",", ":"), ensure_ascii=True)
  return hashlib.sha256(canon.encode()).hexdigest()


def diff(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, Optional[str]]:
  """{relpath: new sha256, or None when deleted} for every path whose content changed."""
  changed: dict[str, Optional[str]] = {
      rel: digest for rel, digest in after.items() if before.get(rel) != digest}
  changed.update({rel: None for rel in before if rel not in after})
  return dict(sorted(changed.items()))


def tree_bytes(workspace: Path) -> int:
  """Total size in bytes of the regular files under workspace (links not followed)."""
  return sum(entry.stat(follow_symlinks=False).st_size for _, entry in _walk(Path(workspace))
             if entry.is_file(follow_symlinks=False))


def claim(workspace: Path, uid: int, gid: int) -> None:
  """chowns workspace and everything in it (links themselves, not targets) to uid:gid.

  The sandboxed code runs as an unprivileged host uid, so files the harness wrote as root
  must become its own to be writable. The workspace folder itself is made 0755: bwrap enters
  it with all capabilities dropped, so it must be searchable by others.
  """
  workspace = Path(workspace)
  if workspace.lstat().st_mode & 0o7777 != 0o755:
    os.chmod(workspace, 0o755)

  def own(path: str, st: os.stat_result) -> None:
    if st.st_uid != uid or st.st_gid != gid:
      os.lchown(path, uid, gid)

  own(str(workspace), workspace.lstat())
  for dirpath, dirnames, filenames in os.walk(workspace, followlinks=False):
    for name in dirnames + filenames:
      path = os.path.join(dirpath, name)
      own(path, os.lstat(path))


def _checked_relpath(rel: str) -> PurePosixPath:
  """The relative path rel, or ValueError naming it when absolute or escaping with '..'."""
  if not isinstance(rel, str) or not rel or "\0" in rel:
    raise ValueError(f"materialize: bad path {rel!r} (must be a non-empty relative path)")
  p = PurePosixPath(rel.replace("\\", "/"))
  if p.is_absolute():
    raise ValueError(f"materialize: path {rel!r} is absolute; only workspace-relative paths")
  if ".." in p.parts:
    raise ValueError(f"materialize: path {rel!r} contains '..'; it would escape the workspace")
  return p


def materialize(files: Mapping[str, bytes | str], root: Path) -> None:
  """Writes {relpath: content} under root (str content as UTF-8), creating folders.

  Refuses, naming the path, an absolute path, a `..` component, or a path whose folder part
  runs through a symlink (which could point outside root). Each file is written atomically.
  """
  root = Path(root)
  checked = {rel: _checked_relpath(rel) for rel in files}  # validate all before writing any
  root.mkdir(parents=True, exist_ok=True)
  for rel, p in checked.items():
    content = files[rel]
    if isinstance(content, str):
      content = content.encode("utf-8")
    elif not isinstance(content, (bytes, bytearray)):
      raise TypeError(f"materialize: content of {rel!r} is {type(content).__name__}, "
                      "expected bytes or str")
    parent = root
    for part in p.parts[:-1]:
      parent = parent / part
      try:
        st = parent.lstat()
      except FileNotFoundError:
        parent.mkdir()
        continue
      if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"materialize: {rel!r} runs through symlink {str(parent)!r}; refusing "
                         "to write through it")
      if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"materialize: {rel!r} needs {str(parent)!r} to be a folder")
    # Scratch files: atomic, but no folder fsync per file (a crash loses the episode).
    io_utils.atomic_write_bytes(parent / p.parts[-1], bytes(content), sync_dir=False)
