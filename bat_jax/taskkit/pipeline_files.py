"""The pipeline/ files of a task workspace: what the code expert writes in S2 and the stage
tools' `setup` installs (one source for both, so `expert` and `toolspace` need not import each
other)."""

from __future__ import annotations

from bat_jax.taskkit import sources
from bat_jax.taskkit.runners import common
from bat_jax.taskkit.scripts import checks, infer, submission

_SIBLING = {"from bat_jax.taskkit.scripts.checks import atomic_write_text  # inlined":
            "from checks import atomic_write_text",
            "from bat_jax.taskkit.runners.common import format_pgm, parse_pgm  # inlined":
            "from checks import format_pgm, parse_pgm"}


def pipeline_sources() -> dict[str, str]:
  """The pipeline/ files the expert writes in S2 (and the stage tools' `setup` installs):
  file name -> standalone stdlib source."""
  return {"checks.py": sources.inline_source(checks) + "\n" + sources.function_sources(
              common.parse_pgm, common.format_pgm),
          "infer.py": sources.inline_source(infer, rewrite=_SIBLING),
          "submission.py": sources.inline_source(submission, rewrite=_SIBLING)}
