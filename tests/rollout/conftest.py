"""Session fixtures of the rollout tests: the tiny model (tokenizer, chat: tests/conftest.py)."""

from __future__ import annotations

import pytest

from rollout_fixtures import tiny_model


@pytest.fixture(scope="session")
def model(tokenizer):
  return tiny_model(len(tokenizer))
