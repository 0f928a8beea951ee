"""The BiCuRL tests' config: exactly `configs/tiny.py:smoke` (what its docstring and the README
document), plus a test's own overrides."""

from __future__ import annotations

from configs import tiny


def fast_config(**overrides):
  """`tiny:smoke`, then `overrides` (dotted names with `__` for `.`)."""
  cfg = tiny.get_config("smoke")
  cfg.update_from_flattened_dict({k.replace("__", "."): v for k, v in overrides.items()})
  return cfg
