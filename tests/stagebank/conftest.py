"""Stage Bank fixtures: tiny rounds built from the synthetic source."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from synthetic_source import SyntheticSource  # noqa: E402

from bat_jax import markers  # noqa: E402
from bat_jax.stagebank import leakcheck  # noqa: E402


@pytest.fixture
def source():
  return SyntheticSource()


@pytest.fixture
def checker():
  return leakcheck.LeakChecker(markers.MarkerMatcher(markers.export_markers(
      ["heldout-case-0042", "answer 7.125 ml"], salt="test-salt")))
