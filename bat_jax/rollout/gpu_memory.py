"""Waiting until a co-located rollout server has really given its GPU memory back.

SGLang's `/release_memory_occupation` answers once the request is handled, but the freed pages
reach the driver asynchronously (torch_memory_saver unmaps them; the caching allocator and CUDA
settle after). A train step started on the answer can find the memory still taken. Like
SGLang's own CI (sgl-project/sglang#31509: poll the visible GPUs until residual memory is
released, abort with a clear message) and the settle polls of other RL stacks, the trainer
reads each GPU's used memory before the release and polls after it until the reading has
dropped and stopped moving, with a deadline and an error that says what was seen.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from typing import Callable, Optional, Sequence

log = logging.getLogger(__name__)

Probe = Callable[[], Optional[Sequence[int]]]


def nvidia_smi_used_mib() -> Optional[list[int]]:
  """MiB in use on each visible GPU (`nvidia-smi`), or None where there is no nvidia-smi (CPU
  hosts: nothing to wait for)."""
  exe = shutil.which("nvidia-smi")
  if exe is None:
    return None
  out = subprocess.run([exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30, check=True).stdout
  return [int(float(line)) for line in out.split() if line.strip()]


def wait_for_release(probe: Probe, before: Optional[Sequence[int]], *, timeout_s: float,
                     poll_s: float = 0.25, tolerance_mib: int = 64,
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> Optional[list[int]]:
  """Polls `probe` until the GPUs' total used memory is below `before`'s (read just before the
  release) by more than `tolerance_mib` and two successive readings agree within it; returns
  the settled reading (None when there is nothing to read).

  Raises:
    TimeoutError: not released and settled within `timeout_s`, naming both readings.
  """
  if before is None:
    return None
  deadline = clock() + timeout_s
  last = None
  while True:
    now = list(probe() or ())
    freed = sum(before) - sum(now) > tolerance_mib
    if freed and last is not None and abs(sum(now) - sum(last)) <= tolerance_mib:
      log.info("rollout server released %d MiB of GPU memory", sum(before) - sum(now))
      return now
    if clock() >= deadline:
      raise TimeoutError(
          f"the rollout server did not give its GPU memory back within {timeout_s:g} s of "
          f"/release_memory_occupation: MiB in use per GPU before {list(before)}, now {now} "
          "(config rollout.sglang.release_timeout_s; the server needs --enable-memory-saver)")
    last = now
    sleep(poll_s)
