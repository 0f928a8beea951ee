"""Runs BiCuRL with the fast test config in WORKDIR (argv[1]); a subprocess target for tests."""

import logging
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from bat_jax import bicurl  # noqa: E402
from tests.bicurl.fast_config import fast_config  # noqa: E402

if __name__ == "__main__":
  logging.basicConfig(level=logging.WARNING)
  logging.getLogger("bat_jax").setLevel(logging.INFO)
  # A save every SFT step: the resume tests' mid-SFT kill point is the first one (ckpt/sft/1).
  bicurl.run(fast_config(sft__checkpoint__every=1), sys.argv[1])
