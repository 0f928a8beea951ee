"""A call's limits and its bwrap command line (pure; `bwrap.py` runs it).

Two ways a root harness makes the code unprivileged (`bwrap.check_available` picks the first
that works here): USERNS, where the launcher drops to the code's uid before bwrap, which then
makes an unprivileged user namespace (as for a harness run by a normal user), and SETPRIV,
where bwrap keeps root to mount and `setpriv` drops to that uid inside (one exec more).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import resource
import shutil
from typing import Optional

from bat_jax.sandbox.process import CHILD_INFO_FD, CHILD_SECCOMP_FD, CHILD_WORKSPACE_FD

INSTALL_HINT = ("install bubblewrap and util-linux (Debian/Ubuntu: `apt-get install bubblewrap "
                "util-linux`) and make sure user namespaces are enabled "
                "(sysctl user.max_user_namespaces > 0)")
SANDBOX_WORKSPACE = "/workspace"
SYSTEM_PYTHON = "/usr/bin/python3"


class SandboxUnavailableError(RuntimeError):
  """bubblewrap (or a helper it needs) is missing or cannot create a sandbox here."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Per-call limits (all finite and > 0). memory_mb caps each process's address space and all
  the memory of the call; max_procs counts the whole call; max_workspace_mb caps each file
  written, the workspace total (watched during the call, checked after it) and each scratch
  tmpfs."""
  wall_s: float = 30.0
  cpu_s: int = 20
  memory_mb: int = 1024
  max_procs: int = 64
  max_output_bytes: int = 1 << 20
  max_workspace_mb: int = 256

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
          or v <= 0:
        raise ValueError(f"SandboxLimits.{f.name} must be a finite positive number, got {v!r}")


# How a call becomes unprivileged (module docstring).
USERNS, SETPRIV = "userns", "setpriv"
# In USERNS mode bwrap's own two processes (outer, PID 1) run as the code's uid too.
_BWRAP_PROCS = 2


@functools.lru_cache(maxsize=None)
def host_tools(setpriv: bool) -> dict[str, str]:
  """Absolute paths of the host binaries the sandbox needs; SandboxUnavailableError if missing."""
  needed = ["bwrap", "prlimit"] + (["setpriv"] if setpriv else [])
  found = {name: shutil.which(name) for name in needed}
  missing = [name for name, path in found.items() if path is None]
  if missing:
    raise SandboxUnavailableError(f"sandbox helper(s) {missing} not found on PATH; {INSTALL_HINT}")
  # Inside the sandbox only /usr is visible, so the helpers must live there too.
  inside = {f"{name}_in": f"/usr/bin/{name}" for name in ("prlimit", "setpriv")}
  for path in [SYSTEM_PYTHON, "/bin/bash"] + [inside[f"{n}_in"] for n in needed if n != "bwrap"]:
    if not os.path.exists(path):
      raise SandboxUnavailableError(f"{path} (needed inside the sandbox) is missing; "
                                    "install Debian's python3, bash and util-linux packages")
  return {**found, **inside}


def _system_mounts() -> list[str]:
  """Read-only /usr and /etc; /bin, /lib, ... as the host has them (merged-/usr links or dirs)."""
  args = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
  for name in ("bin", "sbin", "lib", "lib32", "lib64"):
    host = f"/{name}"
    if os.path.islink(host):
      args += ["--symlink", os.readlink(host), host]
    elif os.path.isdir(host):
      args += ["--ro-bind", host, host]
  return args


def call_rlimits(limits: SandboxLimits, extra_procs: int = 0) -> list[tuple[int, int, int]]:
  """(resource, soft, hard) of a call; extra_procs: processes of the uid that are not the
  code's. The CPU hard limit (SIGKILL) trails the soft one (SIGXCPU), so the usual exit is
  SIGXCPU."""
  procs = limits.max_procs + extra_procs
  return [(resource.RLIMIT_AS, limits.memory_mb << 20, limits.memory_mb << 20),
          (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
          (resource.RLIMIT_NPROC, procs, procs),
          (resource.RLIMIT_FSIZE, limits.max_workspace_mb << 20, limits.max_workspace_mb << 20),
          (resource.RLIMIT_CORE, 0, 0)]


_PRLIMIT_NAMES = {resource.RLIMIT_AS: "as", resource.RLIMIT_CPU: "cpu",
                  resource.RLIMIT_NPROC: "nproc", resource.RLIMIT_FSIZE: "fsize",
                  resource.RLIMIT_CORE: "core"}


def bwrap_argv(*, limits: SandboxLimits, host_uid: Optional[int], command: list[str],
               mode: str = USERNS) -> list[str]:
  """The full bwrap command line for one call (pure; exposed for inspection and tests).

  bwrap gets the workspace (O_PATH, bound at /workspace), its info pipe and the seccomp
  program as fds `process.CHILD_*_FD`; `launch_as` says what the launcher does before it.

  Args:
    limits: the per-call limits.
    host_uid: the unprivileged host uid of the code (the harness is root), or None (the
      harness is a normal user: `prlimit` inside sets the limits).
    command: interpreter argv, e.g. ["/usr/bin/python3", "-c", code].
    mode: USERNS, or SETPRIV (root only: `setpriv` inside drops to host_uid).
  """
  tools = host_tools(mode == SETPRIV)
  scratch = str(limits.max_workspace_mb << 20)
  argv = [tools["bwrap"], "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
          "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
  if mode == USERNS:
    argv += ["--unshare-user", "--disable-userns"]
  else:  # privileged bwrap; only setpriv's uid switch needs capabilities, dropped right after
    argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
             "--cap-add", "CAP_SETPCAP"]  # SETPCAP: setpriv empties the bounding set
  argv += _system_mounts()
  # /tmp and /dev/shm are sticky world-writable like a real system's, but size-capped tmpfs.
  argv += ["--dev", "/dev", "--perms", "1777", "--size", scratch, "--tmpfs", "/dev/shm",
           "--proc", "/proc", "--perms", "1777", "--size", scratch, "--tmpfs", "/tmp",
           "--bind-fd", str(CHILD_WORKSPACE_FD), SANDBOX_WORKSPACE, "--chdir", SANDBOX_WORKSPACE,
           # `python` is the system python3 (stdlib only), whatever the image calls it.
           "--perms", "0755", "--dir", "/sandbox", "--perms", "0755", "--dir", "/sandbox/bin",
           "--symlink", SYSTEM_PYTHON, "/sandbox/bin/python",
           "--symlink", SYSTEM_PYTHON, "/sandbox/bin/python3",
           # The root tmpfs belongs to the code's uid in a user namespace: read-only once built.
           "--remount-ro", "/",
           "--clearenv", "--setenv", "PATH", "/sandbox/bin:/usr/local/bin:/usr/bin:/bin",
           "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
           "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONUNBUFFERED", "1",
           "--info-fd", str(CHILD_INFO_FD), "--seccomp", str(CHILD_SECCOMP_FD), "--"]
  if host_uid is None:
    argv += [tools["prlimit_in"], *(f"--{_PRLIMIT_NAMES[r]}={soft}:{hard}"
                                    for r, soft, hard in call_rlimits(limits)), "--"]
  elif mode == SETPRIV:
    argv += [tools["setpriv_in"], f"--reuid={host_uid}", f"--regid={host_uid}",
             "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
  return argv + command


def launch_as(limits: SandboxLimits, host_uid: Optional[int],
              mode: str) -> tuple[Optional[int], list[tuple[int, int, int]]]:
  """(uid the launcher drops to before bwrap, rlimits it sets on bwrap) for `bwrap_argv`."""
  if host_uid is None:
    return None, []
  if mode == SETPRIV:
    return None, call_rlimits(limits)
  return host_uid, call_rlimits(limits, extra_procs=_BWRAP_PROCS)
