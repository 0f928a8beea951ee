"""`bat_jax.host_memory`: freed host memory is reused instead of faulted in again."""

import subprocess
import sys

import pytest

from bat_jax import host_memory

# Mallocs, writes and frees 64 MiB in a new thread (XLA:CPU's buffers come from its worker
# threads), twice; prints the minor page faults of the second round.
_PROBE = """
import ctypes, ctypes.util, resource, sys, threading
from bat_jax import host_memory
if sys.argv[1] == "retain":
  assert host_memory.retain_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 * 2**20
def touch():
  block = libc.malloc(size)
  ctypes.memset(block, 1, size)
  libc.free(block)
def in_thread():
  thread = threading.Thread(target=touch)
  thread.start()
  thread.join()
in_thread()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
in_thread()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_round_faults(mode: str) -> int:
  out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                       check=True)
  return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_blocks_are_reused_without_page_faults():
  pages = 64 * 2**20 // 4096
  assert _second_round_faults("default") > pages // 2  # glibc unmaps the block: faults again
  assert _second_round_faults("retain") < pages // 100


def test_no_glibc_mallopt_changes_nothing(monkeypatch):
  monkeypatch.setattr(host_memory.ctypes.util, "find_library", lambda name: None)
  assert host_memory.retain_freed_memory() is False


def test_a_rejected_setting_is_an_error_naming_it(monkeypatch):
  class RejectingLibc:
    @staticmethod
    def mallopt(param, value):
      return 0 if param == host_memory.M_ARENA_MAX else 1

  monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: RejectingLibc)
  with pytest.raises(RuntimeError, match=rf"rejected parameters \[{host_memory.M_ARENA_MAX}\]"):
    host_memory.retain_freed_memory()
