"""The one way host code touches agent-made files: no links, no special files, bounded sizes.

Everything in a workspace may have been written by the agent. A path is opened one component at
a time relative to the workspace's fd (`O_NOFOLLOW` at every step, `..` refused), so neither a
planted symlink nor a linked folder on the way leads outside; a final open uses `O_NONBLOCK` so
a FIFO cannot block, then `fstat` must say regular file and the size must fit the caller's cap.
Walks are iterative over directory fds (never recursion, never PATH_MAX-long strings) with depth,
entry and byte budgets: going over is reported as a limit, never raised.

Permissions. A non-root harness runs the code under its own uid, so the agent can strip the
owner's bits of what it made (`chmod 000 dir`, a folder without x). Walks and removal give such
entries their owner bits back first (`restore_owner_bits`, never through a link); what still
cannot be listed or measured ends the walk as "workspace_unreadable", which callers count as
over the size cap (fail closed), never as empty.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import sys
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Optional, Union

PathLike = Union[str, os.PathLike]
_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Default cap of one read: workspace files the harness parses are JSON / CSV / text.
DEFAULT_MAX_READ = 64 << 20


class UnsafeFileError(OSError):
  """An agent-made path that host code refuses to read: a link, a special file, too big, ..."""


@dataclasses.dataclass(frozen=True)
class WalkBudget:
  """Limits of one workspace walk. Going over stops the walk and names the limit."""
  max_depth: int = 48
  max_entries: int = 20_000
  max_bytes: int = 1 << 30


def _parts(rel: str) -> list[str]:
  if not isinstance(rel, str) or not rel or "\0" in rel:
    raise UnsafeFileError(errno.EINVAL, f"bad workspace path {rel!r}")
  parts = [p for p in PurePosixPath(rel.replace("\\", "/")).parts if p not in ("", ".")]
  if not parts or parts[0] == "/" or ".." in parts:
    raise UnsafeFileError(errno.EINVAL, f"workspace path {rel!r} is absolute, empty or has '..'")
  return parts


def open_dir(root: PathLike) -> int:
  """An O_RDONLY fd of the (harness-chosen) root folder itself; the root may not be a link."""
  return os.open(root, _DIR_FLAGS)


def restore_owner_bits(parent: Optional[int], name: PathLike) -> None:
  """Gives folder / regular file parent/name back its owner's rwx / rw bits when this process
  owns it (what the agent may strip under a non-root harness; root reads regardless). Never
  follows a link: the chmod goes through an O_PATH fd of the entry itself."""
  fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
  try:
    st = os.fstat(fd)
    need = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
    if (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)) and \
        st.st_uid == os.geteuid() and st.st_mode & need != need:
      os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(st.st_mode) | need)
  finally:
    os.close(fd)


def _lacks_owner_bits(st: os.stat_result) -> bool:
  return st.st_uid == os.geteuid() and st.st_mode & 0o700 != 0o700


def _open_listed(parent: Optional[int], name: PathLike,
                 st: os.stat_result) -> tuple[int, list[str]]:
  """(fd, sorted names) of folder parent/name (lstat `st`), its owner bits restored first when
  stripped."""
  if _lacks_owner_bits(st):
    restore_owner_bits(parent, name)
  fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
  try:
    return fd, _sorted_names(fd)
  except BaseException:
    os.close(fd)
    raise


def _parent_of(root: PathLike, rel: str) -> tuple[int, str]:
  """(fd of the folder holding rel's last component, that component), reached from root
  without following any link."""
  parts = _parts(rel)
  root_fd = open_dir(root)
  try:
    return _open_parent(root_fd, parts, rel), parts[-1]
  finally:
    os.close(root_fd)


def _open_parent(root_fd: int, parts: list[str], rel: str) -> int:
  """fd of the folder holding parts[-1], reached without following any link."""
  fd = os.dup(root_fd)
  try:
    for part in parts[:-1]:
      try:
        nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
      except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
          raise UnsafeFileError(e.errno, f"{rel!r}: {part!r} is a link or not a folder") from None
        raise
      os.close(fd)
      fd = nxt
    return fd
  except BaseException:
    os.close(fd)
    raise


def _read_fd(fd: int, rel: str, max_bytes: int) -> bytes:
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode):
    raise UnsafeFileError(errno.EINVAL, f"{rel!r} is not a regular file")
  if st.st_size > max_bytes:
    raise UnsafeFileError(errno.EFBIG, f"{rel!r} holds {st.st_size} bytes, over the "
                          f"{max_bytes}-byte cap")
  buf = bytearray()
  while len(buf) <= max_bytes:  # the size can change under us: cap what is read, not stat
    chunk = os.read(fd, min(_CHUNK, max_bytes + 1 - len(buf)))
    if not chunk:
      return bytes(buf)
    buf += chunk
  raise UnsafeFileError(errno.EFBIG, f"{rel!r} grew over the {max_bytes}-byte cap")


def read_bytes(root: PathLike, rel: str, max_bytes: int = DEFAULT_MAX_READ) -> bytes:
  """Bytes of the regular file root/rel, never through a link; UnsafeFileError otherwise.

  Raises FileNotFoundError when it is missing, UnsafeFileError (an OSError) for a link on the
  way, a FIFO / socket / device / folder, or more than max_bytes.
  """
  parent, name = _parent_of(root, rel)
  try:
    try:
      fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
    except OSError as e:
      if e.errno == errno.ELOOP:
        raise UnsafeFileError(e.errno, f"{rel!r} is a symlink") from None
      raise
  finally:
    os.close(parent)
  try:
    return _read_fd(fd, rel, max_bytes)
  finally:
    os.close(fd)


def read_text(root: PathLike, rel: str, max_bytes: int = DEFAULT_MAX_READ) -> str:
  """read_bytes decoded as UTF-8 (UnicodeDecodeError, a ValueError, when it is not)."""
  return read_bytes(root, rel, max_bytes).decode("utf-8")


# Agent-made JSON the harness parses: far deeper or larger than any artifact of the contract is
# hostile (the C decoder recurses per level; a deep enough file exhausts the stack or memory).
MAX_JSON_DEPTH = 64
MAX_JSON_CHARS = 4 << 20
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_ONE_KIND = bytes.maketrans(b"{}", b"[]")


def _reject_constant(name: str):
  raise ValueError(f"non-standard JSON constant {name}")


def parse_json(text: str, *, max_depth: int = MAX_JSON_DEPTH,
               max_chars: int = MAX_JSON_CHARS) -> object:
  """Strict JSON (no NaN / Infinity) nested at most max_depth deep and at most max_chars long.

  Raises ValueError naming the problem (too long, too deep, not JSON, a huge int); never
  RecursionError or MemoryError from a hostile nesting, because the depth is measured first
  by a linear scan of the brackets outside strings.
  """
  if len(text) > max_chars:
    raise ValueError(f"JSON text of {len(text)} chars is over the {max_chars}-char cap")
  # Depth of the brackets outside strings: each pass deletes the innermost pairs (C speed).
  # (UTF-8 never puts an ASCII byte inside a multi-byte letter, so bytes.translate is exact.)
  brackets = _JSON_STRING.sub("", text).encode("utf-8", "surrogatepass").translate(
      _ONE_KIND, _NOT_BRACKETS)
  for _ in range(max_depth):
    if not brackets:
      break
    brackets = brackets.replace(b"[]", b"")
  if b"[]" in brackets:
    raise ValueError(f"JSON nested over {max_depth} levels deep")
  if brackets:
    raise ValueError("JSON brackets do not balance")
  try:
    return json.loads(text, parse_constant=_reject_constant)
  except RecursionError:  # unreachable after the scan; kept so no caller ever sees one
    raise ValueError(f"JSON nested over {max_depth} levels deep") from None


def read_json(root: PathLike, rel: str, max_bytes: int = MAX_JSON_CHARS, *,
              max_depth: int = MAX_JSON_DEPTH) -> object:
  """read_text + parse_json: ValueError / OSError name what is wrong with root/rel."""
  try:
    return parse_json(read_text(root, rel, max_bytes), max_depth=max_depth)
  except ValueError as e:
    raise ValueError(f"{rel!r}: {e}") from None


def kind(root: PathLike, rel: str) -> Optional[str]:
  """"file", "dir", "link" or "other" for root/rel (links on the way: "link"); None if absent."""
  try:
    parent, name = _parent_of(root, rel)
  except UnsafeFileError:
    return "link"
  except OSError:
    return None
  try:
    st = os.lstat(name, dir_fd=parent)
  except OSError:
    return None
  finally:
    os.close(parent)
  return _kind(st.st_mode)


def _kind(mode: int) -> str:
  if stat.S_ISREG(mode):
    return "file"
  if stat.S_ISDIR(mode):
    return "dir"
  return "link" if stat.S_ISLNK(mode) else "other"


def file_sha256(dir_fd: int, name: str, max_bytes: int) -> tuple[str, int]:
  """(sha256, bytes read) of regular file `name` in dir_fd; UnsafeFileError if not one."""
  fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      raise UnsafeFileError(errno.EINVAL, f"{name!r} is not a regular file")
    h, n = hashlib.sha256(), 0
    while chunk := os.read(fd, _CHUNK):
      n += len(chunk)
      if n > max_bytes:
        raise UnsafeFileError(errno.EFBIG, f"{name!r}: over the {max_bytes}-byte budget")
      h.update(chunk)
    return h.hexdigest(), n
  finally:
    os.close(fd)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One non-folder entry of a walk. `dir_fd` is valid only inside the visit callback."""
  rel: str
  name: str
  dir_fd: int
  st: os.stat_result

  @property
  def kind(self) -> str:
    return _kind(self.st.st_mode)


def walk(root: PathLike, budget: WalkBudget = WalkBudget(),
         visit: Optional[Callable[[Entry], int]] = None,
         visit_dir: Optional[Callable[[Entry], Optional[bool]]] = None) -> Optional[str]:
  """Depth-first over root in name order, never following links; iterative, fd-based.

  `visit(entry)` is called for each non-folder entry and returns the bytes it consumed (counted
  against budget.max_bytes); `visit_dir` for each folder before it is entered (returning False
  skips it). Folders whose owner bits were stripped get them back (module docstring). Returns
  None or the limit hit: "workspace_entries", "workspace_bytes" or "workspace_unreadable" (a
  folder that could not be listed or measured; the walk stopped there) or "workspace_depth"
  (folders that deep were not entered; the rest was walked).
  """
  entries = used = 0
  too_deep = False
  stack: list[tuple[int, str, Iterator[str]]] = []
  try:
    try:
      top, names = _open_listed(None, root, os.lstat(root))
    except PermissionError:
      return "workspace_unreadable"
    stack.append((top, "", iter(names)))
    while stack:
      fd, prefix, names = stack[-1]
      name = next(names, None)
      if name is None:
        os.close(stack.pop()[0])
        continue
      entries += 1
      if entries > budget.max_entries:
        return "workspace_entries"
      try:
        st = os.lstat(name, dir_fd=fd)
      except FileNotFoundError:
        continue
      except PermissionError:  # its folder lost x meanwhile: it cannot be measured
        return "workspace_unreadable"
      entry = Entry(f"{prefix}{name}", name, fd, st)
      if not stat.S_ISDIR(st.st_mode):
        used += visit(entry) if visit is not None else st.st_size
        if used > budget.max_bytes:
          return "workspace_bytes"
        continue
      if len(stack) >= budget.max_depth:
        too_deep = True  # not entered; the rest of the walk goes on
        continue
      if visit_dir is not None and visit_dir(entry) is False:
        continue
      try:
        sub, names = _open_listed(fd, name, st)
      except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
          return "workspace_unreadable"  # what it holds is unknown: never counted as nothing
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
          continue  # vanished / swapped for a link: not walked, never followed
        raise
      stack.append((sub, f"{entry.rel}/", iter(names)))
    return "workspace_depth" if too_deep else None
  finally:
    for fd, _, _ in stack:
      os.close(fd)


def _sorted_names(fd: int) -> list[str]:
  with os.scandir(fd) as it:
    return sorted(e.name for e in it)


def remove_tree(path: PathLike) -> None:
  """Removes path and everything under it (or the file / link at path); missing is fine.

  Iterative over directory fds, so depth and path length do not matter: a folder deeper than
  a few levels is first moved up to the top folder under a random name, which bounds the fds
  held. Never follows links; folders without search permission are chmod-ed first.
  """
  path = Path(path)
  try:
    st = os.lstat(path)
  except FileNotFoundError:
    return
  if not stat.S_ISDIR(st.st_mode):
    os.unlink(path)
    return
  parent = os.open(path.parent, _DIR_FLAGS)
  try:
    _clear_dir(parent, path.name)
    os.rmdir(path.name, dir_fd=parent)
  finally:
    os.close(parent)


def remove_tree_quietly(path: PathLike) -> None:
  """remove_tree for cleanup paths: whatever the agent left (deep trees, long or odd names,
  folders without permissions), a failure is reported on stderr, never raised."""
  try:
    remove_tree(path)
  except OSError as e:
    print(f"bat_jax: could not remove {str(path)!r}: {e}", file=sys.stderr)


_MAX_HELD_FDS = 16


def _open_clearable(parent: int, name: str) -> int:
  """fd of folder parent/name with its owner's rwx (to list, stat and unlink in it): a folder
  the agent stripped (non-root harness) gets them back, never through a link."""
  restore_owner_bits(parent, name)
  return os.open(name, _DIR_FLAGS, dir_fd=parent)


def _clear_dir(parent: int, name: str) -> None:
  """Empties folder parent/name (fd-relative, iterative; each folder is listed once)."""
  top = _open_clearable(parent, name)
  # (fd, this folder's name in the one above, names still to handle)
  stack: list[tuple[int, str, Iterator[str]]] = [(top, name, iter(_sorted_names(top)))]
  try:
    while stack:
      fd, own, names = stack[-1]
      sub = next(names, None)
      if sub is None:
        if len(stack) == 1:
          rest = _sorted_names(fd)  # folders moved up meanwhile: another pass over the top
          if rest:
            stack[0] = (fd, own, iter(rest))
            continue
        os.close(stack.pop()[0])
        if stack:
          os.rmdir(own, dir_fd=stack[-1][0])
        continue
      try:
        st = os.lstat(sub, dir_fd=fd)
      except FileNotFoundError:
        continue
      if not stat.S_ISDIR(st.st_mode):
        os.unlink(sub, dir_fd=fd)
      elif len(stack) >= _MAX_HELD_FDS:  # flatten: move it up, finish it from the top later
        os.rename(sub, f".rm-{secrets.token_hex(8)}", src_dir_fd=fd, dst_dir_fd=top)
      else:
        sub_fd = _open_clearable(fd, sub)
        stack.append((sub_fd, sub, iter(_sorted_names(sub_fd))))
  finally:
    for fd, _, _ in stack:
      os.close(fd)
