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


@pytest.mark.parametrize("platforms, expected", [("cpu", True), ("cuda", False),
                                                 ("cuda,cpu", False), (" CPU ", True),
                                                 ("tpu", False)])
def test_jax_platforms_decides_the_backend(monkeypatch, platforms, expected):
  monkeypatch.setenv("JAX_PLATFORMS", platforms)
  assert host_memory.cpu_backend_expected() is expected


def test_without_jax_platforms_a_gpu_needs_both_plugin_and_device(monkeypatch):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  plugins: set[str] = set()
  nodes: list[str] = []

  def distribution(name):
    if name not in plugins:
      raise host_memory.importlib.metadata.PackageNotFoundError(name)
    return object()

  monkeypatch.setattr(host_memory.importlib.metadata, "distribution", distribution)
  monkeypatch.setattr(host_memory.glob, "glob",
                      lambda pattern: [n for n in nodes if n.startswith(pattern[:9])])
  assert host_memory.cpu_backend_expected() is True             # this box: neither
  plugins.add("jax-cuda13-plugin")
  assert host_memory.cpu_backend_expected() is True             # plugin, but no GPU
  nodes.append("/dev/nvidia0")
  assert host_memory.cpu_backend_expected() is False            # a CUDA host
  plugins.clear()
  assert host_memory.cpu_backend_expected() is True             # a GPU JAX cannot use


def test_launch_sets_malloc_only_for_a_cpu_backend(monkeypatch):
  import launch
  calls = []
  monkeypatch.setattr(host_memory, "retain_freed_memory", lambda: calls.append(1) or True)
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  assert launch.apply_host_malloc_settings() is False and calls == []
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert launch.apply_host_malloc_settings() is True and calls == [1]
