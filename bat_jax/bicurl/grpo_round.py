"""One GRPO round: Stage Bank batches -> G rollouts per state_id -> rubric rewards -> update.

The round starts from the last promoted policy with a fresh optimizer, keeps the SFT policy as
the KL reference, and checkpoints (orbax: train state, round-reader position, the round's step
log and phase times) every `grpo.checkpoint.every` steps. Rollouts are replayable: before step
k the engine gets the params of step k and a sampler seed derived from (seed, round, k), so a
run killed mid-round and restarted reproduces the same trajectories and the same params.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from bat_jax import sharding
from bat_jax.checkpointing import Checkpointer
from bat_jax.grpo import (GrpoConfig, OptimizerConfig, StepConfig, build_step_fn,
                          group_advantages, grpo_loss_fn, init_train_state, make_optimizer,
                          make_train_step, memory_report, split_model, step_shardings,
                          taken_token_logprobs)
from bat_jax.rollout import (AgentLoop, RolloutItem, RolloutLimits, SamplingParams, Trajectory,
                             collate, task_environments)
from bat_jax.sandbox import SandboxLimits
from bat_jax.stagebank.reader import RoundReader
from bat_jax.stagebank.rounds import derive_seed

log = logging.getLogger(__name__)

MIN_BUCKET = 128


def run_mesh(cfg: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  """The config's mesh; with every axis size given, over the first that many devices."""
  sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  devices = None if -1 in sizes else jax.devices()[:int(np.prod(sizes))]
  return sharding.make_mesh(*sizes, devices=devices)


def optimizer_config(section: ml_collections.ConfigDict, total_steps: int) -> OptimizerConfig:
  """AdamW settings of the `sft` or `grpo` section."""
  return OptimizerConfig(learning_rate=section.lr, schedule=section.schedule,
                         warmup_steps=section.warmup_steps, total_steps=total_steps,
                         weight_decay=section.weight_decay, max_grad_norm=section.max_grad_norm)


def grpo_config(cfg: ml_collections.ConfigDict) -> GrpoConfig:
  g = cfg.grpo
  return GrpoConfig(advantage_mode=g.advantage.mode, std_normalize=g.advantage.std_normalize,
                    clip_low=g.clip_low, clip_high=g.clip_high, dual_clip=g.dual_clip,
                    kl_coef=g.kl_coef, kl_estimator=g.kl_estimator, loss_agg=g.loss_agg,
                    tis_cap=g.tis_cap, temperature=cfg.rollout.sampling.temperature,
                    logprob_chunk_size=g.logprob_chunk_size)


def bucket_length(longest: int, cap: int) -> int:
  """Padded batch length: the next power of two (>= MIN_BUCKET), at most `cap`, so a round
  compiles a few step shapes rather than one per batch."""
  return min(cap, max(MIN_BUCKET, 1 << max(0, math.ceil(math.log2(max(longest, 1))))))


def rollout_batch(trajectories: list[Trajectory], *, max_len: int, cfg: GrpoConfig,
                  pad_id: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """The GRPO batch (less `old_logp`) and rollout statistics.

  Advantages are computed within each state_id's group only (`group_advantages`).
  """
  longest = max(len(t.token_ids) for t in trajectories)
  batch = collate(trajectories, max_len=bucket_length(longest, max_len), pad_id=pad_id)
  advantages = np.asarray(group_advantages(batch["rewards"], batch["group_ids"],
                                           mode=cfg.advantage_mode,
                                           std_normalize=cfg.std_normalize))
  rewards = batch["rewards"]
  stats = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
           "reward_max": float(rewards.max()),
           "response_tokens": float(np.mean([t.num_response_tokens for t in trajectories])),
           "tool_calls": float(np.mean([t.num_tool_calls for t in trajectories])),
           "errors": float(sum(t.finish_reason == "error" for t in trajectories)),
           "length": float(longest)}
  return {"input_ids": batch["input_ids"], "valid": batch["valid"],
          "loss_mask": batch["loss_mask"],
          "advantages": advantages.astype(np.float32)}, stats


# AOT-compiled train steps, keyed by everything the compiled program depends on.
_COMPILED_STEPS: dict[tuple, Any] = {}


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _acting_logp(graphdef, chunk_size: int, temperature: float, params, rest, input_ids, valid):
  """The acting policy's taken-token logprobs at the sampling temperature, `[B, T]`."""
  model = nnx.merge(graphdef, params, rest)
  logp, _ = taken_token_logprobs(model, input_ids, valid=valid, chunk_size=chunk_size,
                                 temperature=temperature)
  return logp


@dataclasses.dataclass
class RoundOutcome:
  """What a finished round hands back to the outer loop."""
  params: Any                    # the final nnx.Param state
  steps: list[dict[str, float]]  # per-step metrics
  seconds: dict[str, float]      # rollout / update wall time
  healthy: bool


StepHook = Callable[[int, dict[str, float]], None]


class GrpoRound:
  """Runs the GRPO steps of one round (see the module docstring).

  Args:
    cfg: the run config.
    round_index: the round.
    start_model: the policy the round starts from (updated in place at the end).
    ref_params: the KL reference's params (the SFT policy's).
    server: the policy server rollouts are generated with (`bicurl.policy`).
    chat: the policy's chat format.
    checkpoint_dir: this round's orbax directory.
    workspace_root: where rollout workspaces are created.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, round_index: int, start_model: nnx.Module,
               ref_params: Any, server: Any, chat: Any, checkpoint_dir: Path,
               workspace_root: Path):
    self.cfg, self.round_index, self.server, self.chat = cfg, round_index, server, chat
    self.model = start_model
    self.checkpoint_dir = checkpoint_dir
    self.loss_cfg = grpo_config(cfg)
    self.graphdef, params, self.rest = split_model(start_model)
    self.optimizer_cfg = optimizer_config(cfg.grpo, cfg.grpo.steps_per_round)
    self.step_cfg = StepConfig(cfg.grpo.micro_batches, cfg.grpo.remat)
    self.optimizer = make_optimizer(self.optimizer_cfg)
    self.step_fn = build_step_fn(self.graphdef, grpo_loss_fn(self.loss_cfg), self.optimizer,
                                 self.step_cfg)
    self.mesh, self.rules = run_mesh(cfg), tuple(cfg.sharding.rules)
    self.state = init_train_state(params, self.optimizer,
                                  seed=derive_seed("grpo", cfg.seed, round_index) & 0x7FFFFFFF)
    self.frozen = {"rest": self.rest,
                   "ref_params": ref_params if self.loss_cfg.kl_coef > 0 else None}
    self.max_len = cfg.rollout.limits.max_context_tokens or cfg.rollout.jax.max_len
    self.agent_loop = AgentLoop(
        server.engine, chat, task_environments(workspace_root, SandboxLimits(**cfg.sandbox.to_dict()),
                                               cache_dir=workspace_root / "boundary_cache"),
        sampling=SamplingParams(**cfg.rollout.sampling.to_dict()),
        limits=RolloutLimits(**cfg.rollout.limits.to_dict()))

  # -- pieces --------------------------------------------------------------------------------

  def _old_logp(self, params, input_ids, valid):
    return _acting_logp(self.graphdef, self.loss_cfg.logprob_chunk_size,
                        self.loss_cfg.temperature, params, self.rest, input_ids, valid)

  def _compiled_step(self, batch: dict[str, np.ndarray]):
    """The AOT-compiled step for this batch shape; prints XLA's memory analysis once per shape.

    Compiled steps are shared by every round of the process (same model graph, loss, optimizer
    and mesh), so a round does not recompile what the previous one compiled.
    """
    key = (self.graphdef, self.loss_cfg, self.optimizer_cfg, self.step_cfg, self.mesh,
           self.rules, self.frozen["ref_params"] is None, batch["input_ids"].shape)
    if key not in _COMPILED_STEPS:
      shardings = step_shardings(self.state, batch, self.frozen, self.optimizer, self.mesh,
                                 self.rules)
      jitted = make_train_step(self.step_fn, shardings)
      compiled = jitted.lower(self.state, batch, self.frozen).compile()
      report = memory_report(compiled)
      log.info("GRPO step %s memory (MiB): %s", batch["input_ids"].shape,
               {k: round(v / 2**20, 2) for k, v in report.items()})
      _COMPILED_STEPS[key] = compiled
    return _COMPILED_STEPS[key]

  def _serve_current(self, step: int) -> None:
    acting = nnx.merge(self.graphdef, self.state.params, self.rest)
    self.server.load(acting, f"round{self.round_index}-step{step}")
    self.server.reseed(derive_seed("rollout", self.cfg.seed, self.round_index, step) & 0x7FFFFFFF)

  # -- the round -----------------------------------------------------------------------------

  def run(self, round_dir: Path, on_step: Optional[StepHook] = None) -> RoundOutcome:
    """Trains `grpo.steps_per_round` steps on the round's batches, resuming if checkpointed."""
    cfg = self.cfg
    steps = cfg.grpo.steps_per_round
    probe = RoundReader(round_dir)
    reader = RoundReader(round_dir, num_epochs=math.ceil(steps / probe.n_batches))
    history: list[dict[str, float]] = []
    seconds = {"rollout": 0.0, "update": 0.0}
    with Checkpointer(self.checkpoint_dir, max_to_keep=cfg.grpo.checkpoint.keep) as ckpt:
      if ckpt.latest_step() is not None:
        restored = ckpt.restore(self.state)
        self.state = restored.state
        reader.set_state(restored.data_state)
        history, seconds = restored.outer_state["steps"], restored.outer_state["seconds"]
        log.info("round %d: resumed at step %d", self.round_index, restored.step)
      step = int(self.state.step)
      while step < steps:
        rows = next(reader)
        t0 = time.monotonic()
        self._serve_current(step)
        items = [RolloutItem.from_row(r) for r in rows]
        trajectories = self.agent_loop.run(items, cfg.grpo.group_size)
        batch, stats = rollout_batch(trajectories, max_len=self.max_len, cfg=self.loss_cfg,
                                     pad_id=self.chat.endoftext_id)
        t1 = time.monotonic()
        skipped_before = int(self.state.skipped)
        if np.any(batch["advantages"]):
          batch["old_logp"] = self._old_logp(self.state.params, jnp.asarray(batch["input_ids"]),
                                             jnp.asarray(batch["valid"]))
          self.state, metrics = self._compiled_step(batch)(self.state, batch, self.frozen)
          metrics = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
          metrics["no_signal"] = 0.0
        else:
          # Every group's rewards are tied, so the policy term is exactly zero; only the KL term
          # would remain, and AdamW would rescale its ~1e-8 gradient into lr-sized steps that
          # drift the policy with no learning signal. The data still moves on.
          self.state = self.state.replace(step=self.state.step + 1)
          metrics = {"loss": 0.0, "grad_norm": 0.0, "update_applied": 0.0, "no_signal": 1.0}
        t2 = time.monotonic()
        step = int(self.state.step)
        if not all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm")):
          raise FloatingPointError(f"round {self.round_index} step {step}: non-finite GRPO "
                                   f"update (loss {metrics['loss']}, grad_norm "
                                   f"{metrics['grad_norm']})")
        seconds["rollout"] += t1 - t0
        seconds["update"] += t2 - t1
        record = {"step": step, **stats, **metrics,
                  "skipped_now": float(int(self.state.skipped) - skipped_before)}
        history.append(record)
        if on_step is not None:
          on_step(step, record)
        if step % cfg.grpo.checkpoint.every == 0 or step == steps:
          ckpt.save(step, self.state, data_state=reader.get_state(),
                    outer_state={"round": self.round_index, "steps": history, "seconds": seconds})
    nnx.update(self.model, self.state.params)
    healthy = all(r["skipped_now"] == 0 for r in history)
    return RoundOutcome(params=self.state.params, steps=history, seconds=seconds,
                        healthy=healthy)
