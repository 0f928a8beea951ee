"""glibc malloc settings that keep freed host memory for reuse (the CPU backend's buffers).

XLA:CPU mallocs every execution's buffers (the tiny GRPO step: ~600 MB of temp) and frees them
when it ends. With glibc's defaults those blocks come from `mmap` or from per-thread arena heaps
that are unmapped once empty, so the next step faults every page in again: 149k minor faults
and ~0.5 s of kernel time per 1.1 s step of `experiments/perf/grpo_step.py`. One arena, no
`mmap` and no trimming keep the freed pages in the heap for the next step (0 faults).

Call `retain_freed_memory()` first thing in a process, before JAX starts its thread pools:
threads that already own an arena keep it. Only CPU backends want it (`cpu_backend_expected`):
on a GPU host the step's buffers live on the device, and one arena would serialise the host
threads' mallocs (input pipeline, rollout workers) for nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.metadata
import logging
import os

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1

SETTINGS = {M_ARENA_MAX: 1, M_MMAP_MAX: 0, M_TRIM_THRESHOLD: _INT_MAX}


# Distributions that give JAX an accelerator backend, and the device nodes it would open.
ACCELERATOR_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm60-plugin",
                       "jax-rocm7-plugin", "libtpu", "libtpu-nightly")
ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel[0-9]*")


def cpu_backend_expected() -> bool:
  """Whether JAX will run on its CPU backend, decided without initialising JAX (that starts
  the thread pools `retain_freed_memory` must precede): `JAX_PLATFORMS`'s first entry when
  set, else CPU unless an accelerator plugin is installed and its device node exists."""
  platforms = os.environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip().lower() == "cpu"
  installed = set()
  for name in ACCELERATOR_PLUGINS:
    try:
      importlib.metadata.distribution(name)
      installed.add(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return not (installed and any(glob.glob(p) for p in ACCELERATOR_DEVICES))


def retain_freed_memory() -> bool:
  """One malloc arena, no mmap'd blocks, no heap trimming. False (and nothing set) where the C
  library has no glibc `mallopt` (musl, macOS); True once every setting was accepted."""
  name = ctypes.util.find_library("c")
  try:
    mallopt = ctypes.CDLL(name).mallopt if name else None
  except (OSError, AttributeError):
    mallopt = None
  if mallopt is None:
    log.info("host memory: no glibc mallopt in %s; malloc settings unchanged", name)
    return False
  mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
  rejected = [param for param, value in SETTINGS.items() if mallopt(param, value) != 1]
  if rejected:
    raise RuntimeError(f"glibc mallopt rejected parameters {rejected} of {SETTINGS}")
  return True
