r"""Runs BiCuRL: `python launch.py --config=configs/tiny.py --workdir=DIR [--config.x.y=v ...]`.

Configs are locked ml_collections ConfigDicts loaded with `config_flags`: an override of a field
that does not exist (`--config.grpo.lrr=1e-6`) or of the wrong type, a missing config file and
an unusable `--workdir` each fail before anything runs with one line naming the flag
(`bat_jax.config_loading`), and `bat_jax.config_validation` then checks every value, naming
each bad field. Rerunning the same command on the same workdir resumes a killed run; a finished
run ends with a short summary of its scores and where its report, plots and policies are.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "run config file (configs/*.py[:arg])",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (created; reused to resume)")
flags.mark_flags_as_required(["config", "workdir"])


def initialize_distributed(section) -> None:
  """`jax.distributed.initialize` from the config's `distributed` section (coordinator, process
  count and id; e.g. `--config.distributed.process_id=1`), or from the launcher's environment
  (SLURM, Open MPI) when no coordinator is given."""
  import jax
  from bat_jax import sharding
  # CPU hosts need an explicit cross-process collectives backend (GPUs use NCCL regardless).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if section.coordinator_address:
    jax.distributed.initialize(coordinator_address=section.coordinator_address,
                               num_processes=section.num_processes,
                               process_id=section.process_id)
  else:
    sharding.maybe_initialize_distributed()


def _fail(message: str) -> None:
  print(f"launch.py: {message}", file=sys.stderr)
  sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with one-line errors instead of tracebacks: the config file and its
  overrides load, and --workdir is usable, before anything else is imported or run."""
  from bat_jax.config_loading import ConfigLoadError, directory_problem, parse_flags as parse
  try:
    rest = parse(flags.FLAGS, argv, _CONFIG)
  except ConfigLoadError as e:
    _fail(str(e))
  problem = directory_problem(flags.FLAGS.workdir)
  if problem:
    _fail(problem)
  return rest


def _validate(cfg) -> None:
  """Every value of the config; one problem is one line, several are one line each."""
  from bat_jax.config_validation import ConfigError, validate_config
  try:
    validate_config(cfg)
  except ConfigError as e:
    problems = str(e).splitlines()[1:]
    _fail(f"invalid config: {problems[0].strip()}" if len(problems) == 1 else str(e))


def apply_host_malloc_settings() -> bool:
  """Before JAX starts its threads: XLA:CPU's per-step buffers reuse freed pages instead of
  faulting them in again (see bat_jax/host_memory.py; ~17% of the tiny GRPO step). CPU backends
  only: on a GPU host the step's buffers are on the device. True when applied."""
  from bat_jax import host_memory
  return host_memory.cpu_backend_expected() and host_memory.retain_freed_memory()


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    _fail(f"unexpected arguments: {argv[1:]}")
  apply_host_malloc_settings()
  cfg = _CONFIG.value
  _validate(cfg)
  # Library INFO logs (orbax writes several lines per save) stay out; the loop's own stay in.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("bat_jax").setLevel(logging.INFO)
  from bat_jax import bicurl  # after flag parsing: `--help` stays fast
  from bat_jax.bicurl.report import run_summary
  if cfg.memory.layout == "timeshare":  # no pool: between steps JAX holds only its live arrays
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  elif cfg.distributed.xla_mem_fraction is not None:  # before JAX touches a GPU
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(cfg.distributed.xla_mem_fraction))
  if cfg.distributed.enabled:
    initialize_distributed(cfg.distributed)
  # A persistent XLA cache per run: a resumed run does not pay for compiling again.
  import jax
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.join(_WORKDIR.value, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  report = bicurl.run(cfg, _WORKDIR.value)
  print(run_summary(report, _WORKDIR.value))
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
