"""A tiny seccomp filter for the sandbox: no new user namespaces.

Unprivileged user namespaces are the usual first step of kernel privilege escalations. bwrap's
own `--disable-userns` needs a user namespace of the sandbox's own, which a root harness does
not use (see bwrap.py), so the filter refuses `unshare`/`clone` with CLONE_NEWUSER (EPERM) and
`clone3` (ENOSYS: its flags sit behind a pointer that seccomp cannot read; glibc then falls back
to `clone`). Everything else is allowed. The program is raw classic BPF, as bwrap's `--seccomp
FD` expects.
"""

from __future__ import annotations

import errno
import platform
import struct
from typing import Optional

# <linux/filter.h>, <linux/seccomp.h>
_LD_W_ABS = 0x20
_JEQ_K, _JGE_K, _JSET_K = 0x15, 0x35, 0x45
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian).
_NR, _ARCH, _ARG0_LOW = 0, 4, 16
CLONE_NEWUSER = 0x10000000
_X32_SYSCALL_BIT = 0x40000000

# machine -> (AUDIT_ARCH, unshare, clone, clone3, shmget)
_SYSCALLS = {
    "x86_64": (0xC000003E, 272, 56, 435, 29),
    "aarch64": (0xC00000B7, 97, 220, 435, 194),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
  return struct.pack("<HBBI", code, jt, jf, k)


def no_userns_filter(machine: Optional[str] = None, *, no_sysv_shm: bool = False) -> bytes:
  """The BPF program (bytes of struct sock_filter[]) for `machine` (default: this host's).

  no_sysv_shm also refuses `shmget` (EPERM): System V segments outlive every mapping of them,
  so where no memory cgroup charges them the harness could not count them.

  Raises:
    ValueError: naming the machine when it has no syscall table here.
  """
  machine = machine or platform.machine()
  if machine not in _SYSCALLS:
    raise ValueError(f"no seccomp syscall table for machine {machine!r}; "
                     f"known: {sorted(_SYSCALLS)}")
  arch, nr_unshare, nr_clone, nr_clone3, nr_shmget = _SYSCALLS[machine]
  # With no_sysv_shm the shmget test replaces a never-matching one, so offsets stay fixed.
  shm = nr_shmget if no_sysv_shm else 0xFFFFFFFF
  eperm, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
  # Jump offsets count instructions to skip after the current one.
  prog = [
      _insn(_LD_W_ABS, _ARCH),                          # 0
      _insn(_JEQ_K, arch, jt=1, jf=0),                  # 1: native arch -> 3
      _insn(_RET_K, enosys),                            # 2: foreign ABI (e.g. int 0x80): refuse
      _insn(_LD_W_ABS, _NR),                            # 3
      _insn(_JGE_K, _X32_SYSCALL_BIT, jt=0, jf=1),      # 4: x32 ABI numbers -> refuse
      _insn(_RET_K, enosys),                            # 5
      _insn(_JEQ_K, nr_unshare, jt=6, jf=0),            # 6: -> 13
      _insn(_JEQ_K, nr_clone, jt=5, jf=0),              # 7: -> 13
      _insn(_JEQ_K, shm, jt=0, jf=1),                   # 8: -> 9 | 10
      _insn(_RET_K, eperm),                             # 9
      _insn(_JEQ_K, nr_clone3, jt=0, jf=1),             # 10: -> 11 | 12
      _insn(_RET_K, enosys),                            # 11
      _insn(_RET_K, _RET_ALLOW),                        # 12
      _insn(_LD_W_ABS, _ARG0_LOW),                      # 13: flags (low 32 bits)
      _insn(_JSET_K, CLONE_NEWUSER, jt=0, jf=1),        # 14
      _insn(_RET_K, eperm),                             # 15
      _insn(_RET_K, _RET_ALLOW),                        # 16
  ]
  return b"".join(prog)
