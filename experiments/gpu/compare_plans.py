"""Prints two memory-plan JSONs (CPU plan, GPU compile) side by side in GiB, ratio last.

  python experiments/gpu/compare_plans.py plan_cpu.json plan_gpu.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2**30


def byte_leaves(tree, prefix: str = "") -> dict[str, float]:
  """Flattened `per_device` numbers (bytes) keyed by their path."""
  out = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(byte_leaves(value, path + "."))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      out[path] = float(value)
  return out


def main() -> None:
  cpu, gpu = (json.loads(Path(p).read_text()) for p in sys.argv[1:3])
  a, b = byte_leaves(cpu.get("per_device", {})), byte_leaves(gpu.get("per_device", {}))
  print(f"GPU backend: {gpu.get('backend', '?')}")
  print(f"{'per device (GiB)':<32}{'CPU plan':>10}{'GPU':>10}{'GPU/CPU':>9}")
  for key in sorted(set(a) & set(b)):
    ratio = b[key] / a[key] if a[key] else float("nan")
    print(f"{key:<32}{a[key] / GIB:>10.2f}{b[key] / GIB:>10.2f}{ratio:>9.2f}")
  peak_a, peak_b = a.get("peak"), b.get("peak")
  if peak_a and peak_b:
    print(f"peak: CPU plan {peak_a / GIB:.2f} GiB, GPU {peak_b / GIB:.2f} GiB, "
          f"GPU/CPU {peak_b / peak_a:.2f}")


if __name__ == "__main__":
  main()
