"""Host-side workspace helpers: fingerprint, diff, size, ownership, materialise, and the
rename that hides the workspace's host path during a call.

None of these ever follow a symlink: the agent can plant links that point anywhere on the host,
so a link is fingerprinted by its target *string* and never opened, and `materialize` refuses to
write through one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import stat
import tempfile
from pathlib import Path, PurePosixPath
from typing import Iterator, Mapping, Optional

from bat_jax import io_utils
from bat_jax.sandbox import safe_fs

# Domain-separates a symlink's fingerprint from a regular file holding the same bytes.
_SYMLINK_PREFIX = b"symlink\0"


@dataclasses.dataclass(frozen=True)
class Scan:
  """A bounded look at a workspace: fingerprint, total bytes, and the walk limit hit (if any).

  When `limit` is set the fingerprint is partial: what lies past the budget is invisible to the
  rubric (it cannot be credited) and the call that made it is recorded with the limit.
  """
  fp: dict[str, str]
  total_bytes: int
  limit: Optional[str]


def scan(workspace: Path, budget: safe_fs.WalkBudget = safe_fs.WalkBudget(), *,
         hash_files: bool = True) -> Scan:
  """Fingerprints (or, hash_files=False, only sizes) workspace within `budget`."""
  workspace = Path(workspace)
  if not workspace.is_dir():
    raise FileNotFoundError(f"workspace {str(workspace)!r} is not a directory")
  fp: dict[str, str] = {}
  total = 0

  def visit(entry: safe_fs.Entry) -> int:
    nonlocal total
    kind = entry.kind
    size = entry.st.st_size if kind == "file" else 0
    total += size
    if not hash_files:
      return size
    if kind == "link":
      target = os.readlink(entry.name, dir_fd=entry.dir_fd)
      fp[entry.rel] = hashlib.sha256(_SYMLINK_PREFIX + os.fsencode(target)).hexdigest()
    elif kind == "file":
      try:
        fp[entry.rel], size = _file_digest(entry, budget.max_bytes)
      except (safe_fs.UnsafeFileError, FileNotFoundError, PermissionError):
        pass  # swapped for a link / special file since lstat, or unreadable: not content
    return size  # fifo, socket, device: not content the rubric can read

  limit = safe_fs.walk(workspace, budget, visit)
  return Scan(dict(sorted(fp.items())), total, limit)


def _file_digest(entry: safe_fs.Entry, max_bytes: int) -> tuple[str, int]:
  """file_sha256 of a walked file; one the agent made unreadable (non-root harness) gets its
  owner's rw bits back first."""
  try:
    return safe_fs.file_sha256(entry.dir_fd, entry.name, max_bytes)
  except PermissionError:
    safe_fs.restore_owner_bits(entry.dir_fd, entry.name)
    return safe_fs.file_sha256(entry.dir_fd, entry.name, max_bytes)


def fingerprint(workspace: Path) -> dict[str, str]:
  """{relpath: sha256} of every file (and symlink, by target) under workspace, sorted.

  Relpaths use "/" separators. Directories are implied by their files. Symlinks are never
  followed, so a link to a host file fingerprints the link, not the host file. Bounded by the
  default `safe_fs.WalkBudget` (see `scan` for the limit hit).
  """
  return scan(workspace).fp


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
  """Bytes of the regular files under workspace (links not followed; default walk budget)."""
  return scan(workspace, hash_files=False).total_bytes


def claim(workspace: Path, uid: int, gid: int) -> Optional[str]:
  """chowns workspace and everything in it (links themselves, not targets) to uid:gid.

  The sandboxed code runs as an unprivileged host uid, so files the harness wrote as root
  must become its own to be writable. The workspace folder itself is made 0755: bwrap enters
  it with all capabilities dropped, so it must be searchable by others. Bounded like `scan`;
  returns the walk limit hit, if any.
  """
  workspace = Path(workspace)
  st = workspace.lstat()
  if st.st_mode & 0o7777 != 0o755:
    os.chmod(workspace, 0o755)
  if st.st_uid != uid or st.st_gid != gid:
    os.lchown(workspace, uid, gid)

  def own(entry: safe_fs.Entry) -> int:
    if entry.st.st_uid != uid or entry.st.st_gid != gid:
      os.chown(entry.name, uid, gid, dir_fd=entry.dir_fd, follow_symlinks=False)
    return 0

  return safe_fs.walk(workspace, safe_fs.WalkBudget(), own, own)


def prune_to(workspace: Path, keep: Mapping[str, str]) -> None:
  """Removes every entry under workspace that is not in `keep` with the same fingerprint.

  Used to undo a call that broke the workspace caps: what it added or changed goes, what was
  there before stays. Iterative; folders holding nothing to keep are removed whole.
  """
  workspace = Path(workspace)
  keep_dirs = {rel.rsplit("/", i)[0] for rel in keep for i in range(1, rel.count("/") + 1)}
  doomed: list[str] = []

  def visit(entry: safe_fs.Entry) -> int:
    digest = keep.get(entry.rel)
    if digest is None or entry.kind not in ("file", "link"):
      doomed.append(entry.rel)
    elif entry.kind == "link":
      target = os.readlink(entry.name, dir_fd=entry.dir_fd)
      if hashlib.sha256(_SYMLINK_PREFIX + os.fsencode(target)).hexdigest() != digest:
        doomed.append(entry.rel)
    else:
      try:
        ok = safe_fs.file_sha256(entry.dir_fd, entry.name, 1 << 40)[0] == digest
      except OSError:
        ok = False
      if not ok:
        doomed.append(entry.rel)
    return 0

  def visit_dir(entry: safe_fs.Entry) -> bool:
    if entry.rel in keep_dirs:
      return True
    doomed.append(entry.rel)
    return False  # a whole new folder: removed below without walking into it

  safe_fs.walk(workspace, safe_fs.WalkBudget(max_depth=64, max_entries=1 << 62,
                                             max_bytes=1 << 62), visit, visit_dir)
  for rel in doomed:
    safe_fs.remove_tree(workspace / rel)


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


def neutral_stage(workspace: Path) -> Optional[Path]:
  """A private folder, named at random, on the workspace's filesystem (None if none found).

  bwrap's bind shows the source's path inside its filesystem in /proc/self/mountinfo; during
  a call the workspace is renamed into this folder, so that path says nothing about the host
  (a cell's outcome, a user name, a run directory).
  """
  dev = workspace.stat().st_dev
  top = workspace  # the filesystem's top folder: a stage there shows as /<random>/<random>
  while top.parent != top and top.parent.stat().st_dev == dev:
    top = top.parent
  # Fixed system folders first: $TMPDIR may itself name a run, a user or a cell.
  for base in ("/tmp", "/var/tmp", "/dev/shm", str(top), tempfile.gettempdir()):
    try:
      if os.stat(base).st_dev != dev:
        continue
      stage = Path(tempfile.mkdtemp(prefix="", dir=base))
      # Searchable, not listable: bwrap, run as the code's uid, resolves the workspace path.
      os.chmod(stage, 0o711)
    except OSError:
      continue
    return stage
  return None


def remove_stage(stage: str) -> None:
  try:
    os.rmdir(stage)
  except OSError:
    pass


@contextlib.contextmanager
def staged(workspace: Path, stage: Optional[Path]) -> Iterator[Path]:
  """The workspace renamed to a random name in `stage` for the duration (or as is)."""
  if stage is None:
    yield workspace
    return
  hidden = stage / secrets.token_hex(8)
  # Moving a folder to another parent needs write permission on it: the agent may have taken
  # that away (`chmod 555 /workspace` under a non-root harness); it is given back each way.
  safe_fs.restore_owner_bits(None, workspace)
  os.rename(workspace, hidden)
  try:
    yield hidden
  finally:
    safe_fs.restore_owner_bits(None, hidden)
    os.rename(hidden, workspace)
