"""Serving the policy for rollouts and evaluation, and evaluating it.

`rollout.engine` picks the server:

- `jax`: the in-process `JaxEngine`; a new policy is a param swap (`update_params`).
- `sglang`: SGLang servers (launched here or already running at `rollout.sglang.urls`); a new
  policy is exported as HF safetensors and loaded with `update_weights_from_disk`.

`evaluator.kind` picks the teacher: the built-in held-out evaluator drives the served policy
through the rollout package's `PolicyAgent` (cells on threads, so the engine batches their
turns); `external` runs the configured argv on the exported policy. Only the aggregate report
comes back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax.run_config import RunConfig
from bat_jax import sharding
from bat_jax.bicurl import multihost, setup
from bat_jax.checkpointing import export_hf
from bat_jax.evaluator import runner
from bat_jax.evaluator.aggregation import require_complete
from bat_jax.evaluator.evaluate import evaluate
from bat_jax.rollout import (AgentTurn, Completion, Engine, GenerateRequest, JaxEngine,
                             JaxEngineConfig, PolicyAgent, PromptTooLongError, RetryPolicy,
                             SamplingParams, SGLangEngine, SGLangLaunchConfig, ServerProcess,
                             free_port)
from bat_jax.io_utils import atomic_write_json
from bat_jax.model.chat_format import ChatFormat
from bat_jax.rollout import gpu_memory
from bat_jax.rollout.worker import EngineWorker

log = logging.getLogger(__name__)

# Decode steps between the evaluator's batch boundaries (a finished turn's slot is refilled
# within this many tokens): evaluator cells alternate between decoding and running tools, so
# whole-request batches ran ~4 of 16 slots on average.
EVAL_STEP_TOKENS = 16


class PolicyServer(Protocol):
  """Serves one policy version at a time."""
  engine: Engine

  def load(self, model: nnx.Module, version: str) -> None:
    """Serves `model`'s params from now on, labelled `version`."""

  def reseed(self, seed: int) -> None:
    """Restarts the sampler's random stream (in-process engine only)."""

  def rollouts_done(self) -> None:
    """The step's rollouts are over and the train step comes next (the server may free its
    GPU memory until the next `load`)."""

  def close(self) -> None:
    ...


def _host_model(model: nnx.Module) -> nnx.Module:
  """`model` with this host's own copy of its state (`sharding.host_local`: split over the
  host's devices, never gathered onto one); `model` itself with one process."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, sharding.host_local(state))


class JaxPolicyServer:
  """The in-process JAX engine (`rollout.jax`)."""

  def __init__(self, model: nnx.Module, cfg: RunConfig):
    self.engine = JaxEngine(_host_model(model), JaxEngineConfig(
        num_slots=cfg.rollout.jax.batch_size, max_len=cfg.rollout.jax.max_len,
        prefill_chunk=cfg.rollout.jax.prefill_chunk, seed=cfg.seed))

  def load(self, model: nnx.Module, version: str) -> None:
    self.engine.update_params(_host_model(model), version)

  def reseed(self, seed: int) -> None:
    self.engine.reseed(seed)

  def rollouts_done(self) -> None:
    pass  # the engine's cache is part of the trainer's own memory

  def close(self) -> None:
    pass


def sglang_launch_config(cfg: RunConfig, model_path: Path
                         ) -> SGLangLaunchConfig:
  """The server's launch flags from `rollout.sglang` (port 0: a free port now)."""
  sg = cfg.rollout.sglang
  return SGLangLaunchConfig(
      model_path=str(model_path), port=sg.port or free_port(), dtype=sg.dtype,
      mem_fraction_static=sg.mem_fraction_static, tp_size=sg.tp_size, dp_size=sg.dp_size,
      context_length=cfg.rollout.limits.max_context_tokens, random_seed=cfg.seed,
      enable_memory_saver=sg.release_memory, module=sg.server_module,
      extra_args=tuple(sg.extra_args), python=sg.python or sys.executable)


class SGLangPolicyServer:
  """SGLang servers with weight sync from disk after every update (`rollout.sglang`).

  Weights go to the server in `rollout.sglang.dtype` (bf16 by default); the fp32 master copy
  stays with the trainer and its orbax checkpoints. With `rollout.sglang.release_memory` the
  server frees its weights + KV pool after each step's rollouts and takes them back in the
  next `load`, before the new weights are loaded. Rollouts are not replayable after a restart
  on this path (SGLang's sampler is not seeded per step).
  """

  def __init__(self, model: nnx.Module, cfg: RunConfig, export_dir: Path,
               tokenizer_dir: Path, log_path: Path, vision_source: Optional[Path] = None,
               gpu_probe: gpu_memory.Probe = gpu_memory.nvidia_smi_used_mib):
    self.export_dir, self.tokenizer_dir = Path(export_dir), Path(tokenizer_dir)
    self.process: Optional[ServerProcess] = None
    sg = cfg.rollout.sglang
    # More threads than usable CPUs only contend (measured: experiments/perf/weight_sync.py).
    self.export_threads = max(1, min(sg.export_threads, len(os.sched_getaffinity(0))))
    if jax.process_index() == 0:  # the writer
      check_export_room(self.export_dir, 2 * export_bytes(model, sg.dtype))
    self.dtype, self.release_memory = sg.dtype, sg.release_memory
    self.vision_source = vision_source
    self.release_timeout_s = sg.release_timeout_s
    self.gpu_probe = gpu_probe
    self.memory_released = False
    if sg.launch:
      self._export(model, self.export_dir)
      self.process = ServerProcess.sglang(
          sglang_launch_config(cfg, self.export_dir), log_path,
          startup_timeout_s=sg.startup_timeout_s).start()
      url = self.process.base_url
    else:
      url = sg.urls[0]
    self.engine = SGLangEngine(url, timeout_s=sg.request_timeout_s,
                               retry=RetryPolicy(max_retries=sg.max_retries))

  def _export(self, model: nnx.Module, directory: Path) -> None:
    # Every process joins (a leaf spanning hosts is spread over each host's devices); process 0
    # writes, and no server loads the directory before it is complete (staged + renamed). No
    # fsync: a sync is transient, a crash re-exports (the launch export included).
    export_hf(model, directory, tokenizer_dir=self.tokenizer_dir, dtype=self.dtype,
              vision_source=self.vision_source, durable=False,
              write_threads=self.export_threads)
    multihost.barrier(f"exported {directory}")

  def load(self, model: nnx.Module, version: str) -> None:
    if self.memory_released:  # weights must be resident again before they are replaced
      self.engine.resume_memory()
      self.memory_released = False
    self.engine.sync_weights(lambda d: self._export(model, d), self.export_dir, version)

  def reseed(self, seed: int) -> None:
    del seed

  def rollouts_done(self) -> None:
    if self.release_memory and not self.memory_released:
      before = self.gpu_probe()
      self.engine.release_memory()
      self.memory_released = True
      # The step starts only once the freed memory shows as free (not when SGLang answers).
      gpu_memory.wait_for_release(self.gpu_probe, before, timeout_s=self.release_timeout_s)

  def close(self) -> None:
    self.engine.close()
    if self.process is not None:
      self.process.stop()


def export_bytes(model: nnx.Module, dtype: str) -> int:
  """Bytes of `model`'s params stored in `dtype` (one exported version, less the headers)."""
  sizes = [int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]
  return sum(sizes) * jnp.dtype(dtype).itemsize  # jnp: knows "bfloat16"


def check_export_room(export_dir: Path, needed: int) -> None:
  """Raises ValueError naming `rollout.sglang.export_dir` when its filesystem cannot hold
  `needed` bytes (two versions during a swap), counting a version already there as room."""
  probe = Path(export_dir)
  while not probe.exists() and probe != probe.parent:
    probe = probe.parent
  there = sum(f.stat().st_size for f in Path(export_dir).rglob("*") if f.is_file()) \
      if Path(export_dir).is_dir() else 0
  free = shutil.disk_usage(probe).free
  if free + there < needed:
    raise ValueError(
        f"rollout.sglang.export_dir {export_dir}: its filesystem has {(free + there) / 2**30:.1f} "
        f"GiB free for weight syncs, which need {needed / 2**30:.1f} GiB (two versions during a "
        "swap); pick a larger filesystem (e.g. disk instead of /dev/shm)")


def make_policy_server(model: nnx.Module, cfg: RunConfig, workdir: Path,
                       tokenizer_dir: Path) -> PolicyServer:
  if cfg.rollout.engine == "jax":
    return JaxPolicyServer(model, cfg)
  export_dir = Path(cfg.rollout.sglang.export_dir or workdir / "sglang_weights")
  return SGLangPolicyServer(model, cfg, export_dir, tokenizer_dir,
                            workdir / "logs" / "sglang.log", setup.vision_source(cfg))


# --- evaluation --------------------------------------------------------------------------------

def worker_step_tokens(engine: Any) -> Optional[int]:
  """`EngineWorker.step_tokens` for `engine`: the JAX engine continues a session from its
  cache, so requests join a running batch every EVAL_STEP_TOKENS tokens; other engines
  (SGLang batches continuously itself) get whole requests."""
  return EVAL_STEP_TOKENS if isinstance(engine, JaxEngine) else None


class _WorkerEngine:
  """The `Engine` interface over an `EngineWorker`: concurrent cells share batched calls."""

  def __init__(self, worker: EngineWorker):
    self.worker = worker

  def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
    return self.worker.generate_many(requests)

  def release(self, session_ids: Sequence[str]) -> None:
    self.worker.release(session_ids)

  @property
  def weight_version(self) -> str:
    return self.worker.engine.weight_version


class _BoundedAgent(PolicyAgent):
  """A `PolicyAgent` that stops (instead of crashing the cell) when the conversation no longer
  fits the engine's context: running out of context is the policy's outcome, not a fault."""

  def __call__(self, messages: Sequence[Mapping[str, Any]]) -> AgentTurn:
    try:
      return super().__call__(messages)
    except PromptTooLongError:
      return AgentTurn((), thought="(context full)")


def evaluate_policy(cfg: RunConfig, server: PolicyServer,
                    chat_format: ChatFormat,
                    policy_dir: Path, report_path: Path, records_dir: Path, *,
                    progress: Optional[Callable[[int, int, dict], None]] = None
                    ) -> dict[str, Any]:
  """The aggregate report of the served policy (cached in `report_path`).

  The built-in teacher uses greedy decoding, so re-evaluating a policy after a restart gives
  the same report. A report with invalid cells or null scores is an error: the gate could not
  compare it.
  """
  if report_path.is_file():
    return json.loads(report_path.read_text())
  if cfg.evaluator.kind == "external":
    report = cfg.external_evaluator.evaluate(
        policy_dir, {"policy": policy_dir.name, "tier": cfg.evaluator.tier}, records_dir)
  else:
    report = _builtin(cfg, server, chat_format, records_dir, progress)
  require_complete(report, source=f"evaluation of {policy_dir.name}")
  atomic_write_json(report_path, report)
  return report


def _builtin(cfg: RunConfig, server: PolicyServer, chat_format: ChatFormat,
             records_dir: Path, progress: Optional[Callable[[int, int, dict], None]]
             ) -> dict[str, Any]:
  worker = EngineWorker(server.engine, max_batch=max(1, cfg.rollout.max_concurrent_trajectories),
                        step_tokens=worker_step_tokens(server.engine))
  engine = _WorkerEngine(worker)
  greedy = dataclasses.replace(SamplingParams(), temperature=0.0)

  def factory(instance: Any) -> PolicyAgent:
    del instance  # the policy sees only the messages
    return _BoundedAgent(engine, chat_format, sampling=greedy,
                         max_turn_tokens=cfg.rollout.limits.max_turn_tokens)

  try:
    return evaluate(factory, records_dir, settings=cfg.evaluation,
                    options=runner.RunOptions(workers=cfg.evaluator.workers, threads=True),
                    progress=progress)
  finally:
    worker.close()
