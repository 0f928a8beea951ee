"""`execute_code` for real: each call runs in a fresh bubblewrap sandbox.

Isolation per call: new pid / net / ipc / uts (/ cgroup) namespaces, a tmpfs root holding only
read-only /usr and /etc, private /proc, /dev, /tmp and /dev/shm (size-capped tmpfs), and the
task workspace bound read-write at /workspace (the cwd). The environment is cleared.

Limits. RLIMIT_AS (memory per process), RLIMIT_CPU, RLIMIT_FSIZE and RLIMIT_NPROC are set on
bwrap as it starts (by the launcher, so everything in the sandbox inherits them; a non-root
harness runs `prlimit` inside the sandbox instead, as all its processes count towards its
uid's RLIMIT_NPROC). Every call's bwrap is forked by the Sandbox's long-lived launcher
(`launcher.py`). The call's memory as a whole (anonymous, shared mappings, memfd, SysV / POSIX
shm, its /tmp and /dev/shm tmpfs) is charged to the Sandbox's memory cgroup, which holds the
launcher, when the host allows one (`cgroup.py`); otherwise it is polled (`monitor.py`) and
SysV shm, which nothing could count, is refused. The workspace's size, entry
count and depth are watched during the call and checked after it; over a cap, the sandbox is
killed and whatever the call added or changed is removed (`workspace.prune_to`), so nothing over
a cap stays or is credited. RLIMIT_NPROC never binds host uid 0 (the kernel exempts the root
user, also through a user namespace that maps to it), so when the harness runs as root the code
runs as a random unprivileged host uid, and the workspace is chowned to it: the launcher drops
to that uid before bwrap, which then makes an unprivileged user namespace (mode USERNS, as for a
harness run by a normal user; bwrap drops every capability in it and refuses nested user
namespaces); where the host refuses unprivileged user namespaces, bwrap keeps root to mount and
`setpriv` drops to the uid inside (mode SETPRIV, one exec more per call).
Wall time, output size and the tree's memory are enforced from the host: at any of them the
sandbox's PID 1 is SIGKILLed, which kills every process of its pid namespace. A normal exit of
the main process ends PID 1 too, so nothing the code started outlives the call.

Host side. Every call writes an evidence record, also when the harness fails mid-call
(`limit_hit="harness_error"`, then the error propagates). The workspace is walked only through
`safe_fs` (no links followed, bounded budgets), and during a call it is renamed into a private,
randomly named folder, so /proc/self/mountinfo inside shows no host path. Under a non-root
harness the agent owns its files: folders and files whose owner bits it stripped get them back
before they are walked, moved or removed, and what still cannot be measured counts as over the
size cap. A launcher the OOM killer takes mid-call is replaced; that call is a memory-limit hit.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import secrets
import signal
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

from bat_jax import workflow
from bat_jax.sandbox import cgroup
from bat_jax.sandbox import evidence as evidence_lib
from bat_jax.sandbox import launcher as launcher_lib
from bat_jax.sandbox import safe_fs
from bat_jax.sandbox import workspace as workspace_lib
# Re-exported: callers know these as bwrap.*.
from bat_jax.sandbox.command import (INSTALL_HINT, SANDBOX_WORKSPACE, SETPRIV,  # noqa: F401
                                     SYSTEM_PYTHON, USERNS, SandboxLimits,
                                     SandboxUnavailableError, bwrap_argv, call_rlimits,
                                     host_tools, launch_as)
from bat_jax.sandbox.process import Completed, call_fds, run_bwrap

# argv strings cannot exceed MAX_ARG_STRLEN (32 pages) on Linux; stay below it.
MAX_CODE_BYTES = 120_000
_INTERPRETERS = {"python": (SYSTEM_PYTHON, "-c"), "bash": ("/bin/bash", "-c")}
_SIGXCPU_EXIT = 128 + signal.SIGXCPU
# RLIMIT_CPU's hard limit (a second after the soft one) is the one in-sandbox SIGKILL we set.
_SIGKILL_EXIT = 128 + signal.SIGKILL
_SIGXFSZ_EXIT = 128 + signal.SIGXFSZ
# Messages the interpreters print when RLIMIT_AS / RLIMIT_NPROC make a call fail.
_MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")
_PROCS_SIGNS = ("fork: retry", "fork: Resource temporarily unavailable", "can't start new thread")
# Also EAGAIN from non-blocking I/O, so it only counts when the call failed.
_PROCS_FAILED_SIGNS = ("BlockingIOError: [Errno 11]",)
# Random host uids for sandboxed code, far from system and login uids.
_HOST_UID_MIN, _HOST_UID_SPAN = 3_000_000, 1_000_000


@dataclasses.dataclass(frozen=True)
class ExecResult:
  """The outcome of one call. `observation` is what the agent sees."""
  exit_code: int
  stdout: str
  stderr: str
  duration_s: float
  timed_out: bool
  limit_hit: Optional[str]
  observation: str


def _limit_hit(done: Completed, stderr: str) -> Optional[str]:
  """Which limit stopped the call. Memory/procs are read from the interpreters' own errors."""
  if done.timed_out:
    return "wall"
  if done.output_exceeded:
    return "output"
  if done.memory_exceeded:
    return "memory"
  if done.watch_limit is not None:
    return done.watch_limit
  if done.returncode in (_SIGXCPU_EXIT, _SIGKILL_EXIT):
    return "cpu"
  if done.returncode == _SIGXFSZ_EXIT or "File size limit exceeded" in stderr:
    return "workspace"
  if done.returncode != 0 and any(s in stderr for s in _MEMORY_SIGNS):
    return "memory"
  if any(s in stderr for s in _PROCS_SIGNS) or (
      done.returncode != 0 and any(s in stderr for s in _PROCS_FAILED_SIGNS)):
    return "procs"
  return None


def _limit_note(limit: str, limits: SandboxLimits) -> str:
  what = {
      "wall": f"wall-time limit of {limits.wall_s:g} s hit: the whole process tree was killed",
      "output": f"output limit of {limits.max_output_bytes} bytes hit: the whole process tree "
                "was killed and the output is cut",
      "cpu": f"CPU-time limit of {limits.cpu_s} s hit: the process was killed",
      "memory": f"memory limit of {limits.memory_mb} MB hit: an allocation was refused or "
                "the whole process tree was killed",
      "procs": f"process limit of {limits.max_procs} processes hit: a fork failed",
      "workspace": f"workspace size limit of {limits.max_workspace_mb} MB hit (or a folder "
                   "could not be measured): the files this call added or changed were removed",
      "workspace_entries": f"workspace holds more than {_WALK.max_entries} entries: the "
                           "entries this call added or changed were removed",
      "workspace_depth": f"workspace is nested deeper than {_WALK.max_depth - 1} folders: "
                         "the entries this call added or changed were removed",
      "code_size": f"code is longer than {MAX_CODE_BYTES} bytes or holds a NUL byte: not run",
      "code_encoding": "code holds a lone surrogate (not encodable as UTF-8): not run",
  }[limit]
  return f"[sandbox] {what}"


def _observation(exit_code: int, stdout: str, stderr: str, note: Optional[str]) -> str:
  """workflow.format_observation, keeping a limit note visible even when stdout is huge."""
  if note is None:
    return workflow.format_observation(exit_code, stdout, stderr)
  stderr = f"{note}\n{stderr}" if stderr else note
  budget = workflow.MAX_OBSERVATION_CHARS // 2  # the rest is for the header, note and stderr
  if len(stdout) > budget:
    stdout = f"{stdout[:budget]}\n...[cut {len(stdout) - budget} chars]"
  return workflow.format_observation(exit_code, stdout, stderr)


_WALK = safe_fs.WalkBudget()
_DISK_LIMITS = ("workspace", "workspace_entries", "workspace_depth")
# Walk limits that leave the size unknown: over the cap (a folder made unreadable hides nothing).
_UNMEASURED = ("workspace_bytes", "workspace_unreadable")


def _code_problem(code: str) -> Optional[str]:
  """Why code cannot be run at all ("code_size", "code_encoding"), or None."""
  try:
    size = len(code.encode("utf-8"))
  except UnicodeEncodeError:
    return "code_encoding"
  return "code_size" if size > MAX_CODE_BYTES or "\0" in code else None


def _probe(as_root: bool, mode: str) -> Optional[str]:
  """Runs a trivial sandbox in `mode`; None if it worked, else what went wrong."""
  with tempfile.TemporaryDirectory(prefix="bat-sandbox-probe-") as tmp:
    host_uid = _HOST_UID_MIN if as_root else None
    if host_uid is not None:
      workspace_lib.claim(Path(tmp), host_uid, host_uid)
    run_as, rlimits = launch_as(SandboxLimits(), host_uid, mode)
    with call_fds(Path(tmp)) as fds:
      argv = bwrap_argv(limits=SandboxLimits(), host_uid=host_uid, mode=mode,
                        command=["/bin/sh", "-c", "echo ok > probe"])
      done = run_bwrap(argv, fds, wall_s=30.0, max_output_bytes=1 << 16,
                       max_memory_bytes=1 << 30, run_as=run_as, rlimits=rlimits)
    if done.returncode == 0 and os.path.exists(os.path.join(tmp, "probe")):
      return None
    return f"{mode}: exit {done.returncode}: {done.stderr.decode(errors='replace').strip()!r}"


@functools.lru_cache(maxsize=None)
def check_available(as_root: bool) -> str:
  """Runs a trivial sandbox once per process and returns the mode that works (USERNS first;
  as root, SETPRIV next); SandboxUnavailableError says why none does."""
  failures = []
  for mode in (USERNS, SETPRIV) if as_root else (USERNS,):
    failure = _probe(as_root, mode)
    if failure is None:
      return mode
    failures.append(failure)
  how = ("as root, bwrap needs CAP_SYS_ADMIN to make mount namespaces (in a container: "
         "--cap-add SYS_ADMIN or --privileged)" if as_root else INSTALL_HINT)
  raise SandboxUnavailableError(
      f"bubblewrap cannot create a sandbox here ({'; '.join(failures)}); {how}")


class Sandbox:
  """Runs agent code in `workspace` under bubblewrap and keeps the evidence log.

  Args:
    workspace: the task folder; the only writable path, mounted at /workspace.
    limits: per-call limits.
    evidence_path: JSONL evidence log; must lie outside the workspace. Records already in it
      are loaded and new calls continue its call_index. None keeps the log in memory only.

  Raises:
    SandboxUnavailableError: bubblewrap is missing or unusable (never runs unsandboxed).
  """

  def __init__(self, workspace: Path, limits: SandboxLimits = SandboxLimits(),
               evidence_path: Optional[Path] = None):
    self.workspace = Path(workspace).resolve()
    if not self.workspace.is_dir():
      raise FileNotFoundError(f"sandbox workspace {str(self.workspace)!r} is not a directory")
    self.limits = limits
    self.evidence_path = None if evidence_path is None else Path(evidence_path).resolve()
    if self.evidence_path is not None and self.evidence_path.is_relative_to(self.workspace):
      raise ValueError(f"evidence_path {str(evidence_path)!r} is inside the workspace "
                       f"{str(self.workspace)!r}; the agent could forge it")
    as_root = os.geteuid() == 0
    self.mode = check_available(as_root)
    # Random per sandbox so concurrent sandboxes do not share one RLIMIT_NPROC count.
    self.host_uid: Optional[int] = (
        _HOST_UID_MIN + 1 + secrets.randbelow(_HOST_UID_SPAN) if as_root else None)
    self._records: list[evidence_lib.EvidenceRecord] = (
        evidence_lib.load_evidence(self.evidence_path)
        if self.evidence_path is not None and self.evidence_path.exists() else [])
    self._lock = threading.Lock()
    self._launcher_now: Optional[launcher_lib.Launcher] = None  # started by the first call
    self._stage = workspace_lib.neutral_stage(self.workspace)
    if self._stage is not None:
      weakref.finalize(self, workspace_lib.remove_stage, str(self._stage))

  @property
  def launcher(self) -> Optional[launcher_lib.Launcher]:
    """The launcher serving this Sandbox's calls: None before the first call and after close."""
    return self._launcher_now

  def close(self) -> None:
    """Stops this Sandbox's launcher and removes its memory cgroup now (garbage collection does
    it otherwise); a later call starts a new launcher."""
    with self._lock:
      if self._launcher_now is not None:
        self._launcher_finalizer()
        self._launcher_now = None

  @property
  def evidence(self) -> list[evidence_lib.EvidenceRecord]:
    """Every call so far, in order."""
    return list(self._records)

  def execute(self, language: str, code: str) -> ExecResult:
    """Runs `code` with `language` ("python" or "bash") and records it in the evidence log."""
    if language not in _INTERPRETERS:
      raise ValueError(f"unknown language {language!r}; expected one of "
                       f"{workflow.TOOL_LANGUAGES}")
    if not isinstance(code, str):
      raise TypeError(f"code must be a str, got {type(code).__name__}")
    with self._lock:
      return self._execute_locked(language, code)

  def _execute_locked(self, language: str, code: str) -> ExecResult:
    start = time.monotonic()
    before = after = {}
    done = Completed(-1, b"", b"", False, False)
    limit: Optional[str] = None
    finished = False
    try:
      if self.host_uid is not None:
        workspace_lib.claim(self.workspace, self.host_uid, self.host_uid)
      before = after = self._scan().fp
      limit = _code_problem(code)
      done = self._run(language, code) if limit is None else Completed(2, b"", b"", False, False)
      stderr = done.stderr.decode("utf-8", "replace")
      limit = limit or _limit_hit(done, stderr)
      found = self._scan()
      over = "workspace" if found.limit in _UNMEASURED or \
          found.total_bytes > self.limits.max_workspace_mb << 20 else found.limit
      if over is not None or limit in _DISK_LIMITS:  # over a cap: what the call did goes
        limit = limit if limit in _DISK_LIMITS else over
        workspace_lib.prune_to(self.workspace, before)
        found = self._scan()
      after = found.fp
      finished = True
    finally:
      duration = time.monotonic() - start
      self._record(evidence_lib.EvidenceRecord(
          call_index=len(self._records), language=language,
          code_sha256=hashlib.sha256(code.encode("utf-8", "surrogatepass")).hexdigest(),
          exit_code=done.returncode, duration_s=duration, timed_out=done.timed_out,
          fingerprint_before=workspace_lib.fingerprint_digest(before),
          fingerprint_after=workspace_lib.fingerprint_digest(after),
          changed=workspace_lib.diff(before, after),
          limit_hit=limit if finished else "harness_error"))
    stdout = done.stdout.decode("utf-8", "replace")
    note = None if limit is None else _limit_note(limit, self.limits)
    return ExecResult(exit_code=done.returncode, stdout=stdout, stderr=stderr,
                      duration_s=duration, timed_out=done.timed_out, limit_hit=limit,
                      observation=_observation(done.returncode, stdout, stderr, note))

  def _scan(self) -> workspace_lib.Scan:
    cap = self.limits.max_workspace_mb << 20
    return workspace_lib.scan(self.workspace, dataclasses.replace(_WALK, max_bytes=2 * cap))

  def _watch(self, staged: Path) -> Callable[[], Optional[str]]:
    """The in-call disk check: size, entries and depth of the (staged) workspace."""
    budget = dataclasses.replace(_WALK, max_bytes=self.limits.max_workspace_mb << 20)

    def check() -> Optional[str]:
      limit = workspace_lib.scan(staged, budget, hash_files=False).limit
      return "workspace" if limit in _UNMEASURED else limit
    return check

  def _launcher(self) -> launcher_lib.Launcher:
    """This Sandbox's launcher, (re)started when missing, dead, or of the wrong cgroup mode."""
    want_group = cgroup.available()
    current = self._launcher_now
    if current is not None and current.alive() and (current.group is not None) == want_group:
      return current
    if current is not None:
      self._launcher_finalizer.detach()
      current.close()
    group = cgroup.MemoryCgroup(self.limits.memory_mb << 20) if want_group else None
    self._launcher_now = launcher_lib.Launcher(group)
    self._launcher_finalizer = weakref.finalize(self, self._launcher_now.close)
    return self._launcher_now

  def _run(self, language: str, code: str) -> Completed:
    launcher = self._launcher()
    with workspace_lib.staged(self.workspace, self._stage) as staged, \
        call_fds(staged, no_sysv_shm=launcher.group is None) as fds:
      argv = bwrap_argv(limits=self.limits, host_uid=self.host_uid, mode=self.mode,
                        command=[*_INTERPRETERS[language], code])
      run_as, rlimits = launch_as(self.limits, self.host_uid, self.mode)
      return run_bwrap(argv, fds, wall_s=self.limits.wall_s,
                       max_output_bytes=self.limits.max_output_bytes,
                       max_memory_bytes=self.limits.memory_mb << 20, launcher=launcher,
                       run_as=run_as, rlimits=rlimits, watch=self._watch(staged))

  def _record(self, record: evidence_lib.EvidenceRecord) -> None:
    if self.evidence_path is not None:
      evidence_lib.append_record(self.evidence_path, record)
    self._records.append(record)
