"""Shared test fixtures. Tests mirror the package layout and build tiny fixtures themselves."""

import os
import shutil

import pytest

# Tests run on CPU; fake devices let sharding tests build 8-device meshes.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _has_gpu() -> bool:
  try:
    import jax
    return any(d.platform == "gpu" for d in jax.devices())
  except Exception:  # pragma: no cover - no GPU backend installed
    return False


def pytest_collection_modifyitems(config, items):
  gpu = None
  for item in items:
    if "gpu" in item.keywords:
      if gpu is None:
        gpu = _has_gpu()
      if not gpu:
        item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def require_bwrap():
  if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
