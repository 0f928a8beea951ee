"""Sandbox fixtures: a fresh workspace + evidence log per test."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from sandbox_helpers import FAST

from bat_jax.sandbox import Sandbox, SandboxLimits, materialize


@pytest.fixture
def make_sandbox(tmp_path: Path, require_bwrap) -> Callable[..., Sandbox]:
  """make_sandbox(limits=FAST, files=None) -> Sandbox over tmp_path/ws, log at tmp_path."""

  def make(limits: SandboxLimits = FAST, files=None) -> Sandbox:
    ws = tmp_path / "ws"
    materialize(files or {"data/input.txt": "42\n"}, ws)
    return Sandbox(ws, limits, evidence_path=tmp_path / "evidence.jsonl")

  return make
