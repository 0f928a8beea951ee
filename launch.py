r"""Runs BiCuRL: `python launch.py --config=configs/tiny.py --workdir=DIR [--config.x.y=v ...]`.

Configs are locked ml_collections ConfigDicts loaded with `config_flags`: an override of a field
that does not exist (`--config.grpo.lrr=1e-6`) or of the wrong type fails before anything runs,
and `bat_jax.config_validation` then checks every value, naming each bad field. Rerunning the
same command on the same workdir resumes a killed run.
"""

from __future__ import annotations

import json
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


def apply_host_malloc_settings() -> bool:
  """Before JAX starts its threads: XLA:CPU's per-step buffers reuse freed pages instead of
  faulting them in again (see bat_jax/host_memory.py; ~17% of the tiny GRPO step). CPU backends
  only: on a GPU host the step's buffers are on the device. True when applied."""
  from bat_jax import host_memory
  return host_memory.cpu_backend_expected() and host_memory.retain_freed_memory()


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  apply_host_malloc_settings()
  # Library INFO logs (orbax writes several lines per save) stay out; the loop's own stay in.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("bat_jax").setLevel(logging.INFO)
  from bat_jax import bicurl  # after flag parsing: `--help` stays fast
  from bat_jax.config_validation import ConfigError, validate_config
  cfg = _CONFIG.value
  try:
    validate_config(cfg)
  except ConfigError as e:
    print(e, file=sys.stderr)
    return 2
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
  print(json.dumps({"evaluations": report["evaluations"], "phase_seconds": report["phase_seconds"]},
                   indent=1))
  return 0


if __name__ == "__main__":
  app.run(main)
