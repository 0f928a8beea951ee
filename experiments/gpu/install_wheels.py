"""Installs offline, into SITE, the wheels of the modules the GPU check needs that this Python
cannot import (only those: what the box has stays as it is).

  python experiments/gpu/install_wheels.py WHEELHOUSE SITE

The wheelhouse comes from tools/gpu_wheelhouse.sh. A module that is missing with no wheelhouse
to install it from is reported as "missing module: X" (exit 1).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

# Module -> distribution: tools/gpu_wheelhouse.sh's list.
NEEDED = {"flax": "flax", "optax": "optax", "absl": "absl-py", "ml_collections": "ml_collections",
          "treescope": "treescope", "rich": "rich", "markdown_it": "markdown-it-py",
          "mdurl": "mdurl", "pygments": "pygments", "etils": "etils",
          "cloudpickle": "cloudpickle", "msgpack": "msgpack", "pytest": "pytest",
          "iniconfig": "iniconfig", "pluggy": "pluggy"}


def main(wheelhouse: Path, site: Path) -> int:
  missing = {mod: dist for mod, dist in NEEDED.items() if importlib.util.find_spec(mod) is None}
  print("present:", sorted(set(NEEDED) - set(missing)))
  if not missing:
    print("nothing to install")
    return 0
  if not wheelhouse.is_dir():
    for mod in missing:
      print(f"missing module: {mod} (no wheelhouse at {wheelhouse}: bash tools/gpu_wheelhouse.sh)")
    return 1
  cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
         "--find-links", str(wheelhouse), "--target", str(site), *missing.values()]
  print(" ".join(cmd), flush=True)
  if subprocess.call(cmd):
    return 1
  importlib.invalidate_caches()
  still = [mod for mod in missing if importlib.util.find_spec(mod) is None]
  for mod in still:
    print(f"missing module: {mod} (installed into {site}, still not importable)")
  print(f"installed {sorted(missing.values())} into {site}")
  return 1 if still else 0


if __name__ == "__main__":
  sys.path.insert(0, sys.argv[2])  # where the wheels go: found by the re-check above
  sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
