"""One GRPO round: Stage Bank batches -> G rollouts per state_id -> rubric rewards -> update.

The round starts from the last promoted policy with a fresh optimizer, keeps the SFT policy
(`grpo.kl_reference = "sft"`) or the round's start policy (`"round_start"`) as the KL
reference, and checkpoints (orbax: train state, round-reader position, the round's step
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
from bat_jax.bicurl import multihost
from bat_jax.checkpointing import Checkpointer
from bat_jax.grpo import (GrpoConfig, OptimizerConfig, StepConfig, build_step_fn,
                          group_advantages, grpo_loss_fn, init_train_state, make_optimizer,
                          make_train_step, memory_report, split_model, step_shardings,
                          taken_token_logprobs)
from bat_jax.rollout import (AgentLoop, RolloutItem, RolloutLimits, SamplingParams, Trajectory,
                             collate, task_environments)
from bat_jax.grpo.advantages import valid_group_members
from bat_jax.grpo.loss import sampler_gap_stats
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
                    norm_length=g.loss_norm_length or cfg.rollout.limits.max_response_tokens,
                    logprob_chunk_size=g.logprob_chunk_size)


def bucket_length(longest: int, cap: int) -> int:
  """Padded batch length: the next power of two (>= MIN_BUCKET), at most `cap`, so a round
  compiles a few step shapes rather than one per batch."""
  return min(cap, max(MIN_BUCKET, 1 << max(0, math.ceil(math.log2(max(longest, 1))))))


def rollout_batch(trajectories: list[Trajectory], *, max_len: int, cfg: GrpoConfig,
                  pad_id: int, longest: Optional[int] = None
                  ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """The GRPO batch (less `old_logp`) and rollout statistics.

  Errored and aborted trajectories (`Trajectory.trainable` False) are infrastructure failures,
  not policy behaviour: they get loss mask 0 and stay out of their group's baseline. A group
  left with fewer than 2 trainable members has no baseline and is dropped (mask 0). Rows are
  kept (zeroed, not removed) so the batch shape, and hence the compiled step, stays the same.
  Advantages are computed within each state_id's group only (`group_advantages`). `longest`
  (default: of these trajectories) sets the padded length, so processes can agree on one.
  """
  longest = longest or max(len(t.token_ids) for t in trajectories)
  collated = collate(trajectories, max_len=bucket_length(longest, max_len), pad_id=pad_id)
  valid = np.array([t.trainable for t in trajectories])
  members = np.asarray(valid_group_members(collated["group_ids"], valid))
  keep = valid & (members >= 2)
  advantages = np.asarray(group_advantages(collated["rewards"], collated["group_ids"],
                                           valid=valid, mode=cfg.advantage_mode,
                                           std_normalize=cfg.std_normalize))
  rewards = collated["rewards"][valid] if valid.any() else np.zeros(1, np.float32)
  reasons = [t.finish_reason for t in trajectories]
  dropped_groups = {g for g, v, n in zip(collated["group_ids"], valid, members) if n < 2}
  stats = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
           "reward_max": float(rewards.max()),
           "response_tokens": float(np.mean([t.num_response_tokens for t in trajectories])),
           "tool_calls": float(np.mean([t.num_tool_calls for t in trajectories])),
           "errors": float(reasons.count("error")), "aborted": float(reasons.count("aborted")),
           "excluded_trajectories": float((~keep).sum()),
           "dropped_groups": float(len(dropped_groups)), "length": float(longest)}
  # The sampler's logprobs ride along for truncated IS and the sampler_gap metric.
  return {"input_ids": collated["input_ids"],
          "loss_mask": collated["loss_mask"] * keep[:, None].astype(np.float32),
          "advantages": np.where(keep, advantages, 0.0).astype(np.float32),
          "sampler_logp": collated["sampler_logp"]}, stats


@jax.jit
def _sampler_gap_sums(old_logp, sampler_logp, loss_mask):
  mask = loss_mask.astype(jnp.float32)
  return {**sampler_gap_stats(old_logp, sampler_logp, mask), "tokens": mask.sum()}


def sampler_gap(old_logp: jax.Array, batch: dict[str, Any]) -> dict[str, float]:
  """Mean and max |trainer old_logp - sampler logprob| over the loss tokens (0 when none)."""
  sums = jax.device_get(_sampler_gap_sums(old_logp, batch["sampler_logp"], batch["loss_mask"]))
  return {"sampler_gap": float(sums["sampler_gap_sum"]) / max(float(sums["tokens"]), 1.0),
          "sampler_gap_max": float(sums["sampler_gap_max"])}


# AOT-compiled train steps, keyed by everything the compiled program depends on.
_COMPILED_STEPS: dict[tuple, Any] = {}


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _acting_logp(graphdef, chunk_size: int, temperature: float, params, rest, input_ids):
  """The acting policy's taken-token logprobs at the sampling temperature, `[B, T]`."""
  model = nnx.merge(graphdef, params, rest)
  logp, _ = taken_token_logprobs(model, input_ids, chunk_size=chunk_size, temperature=temperature)
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
    ref_params: the SFT policy's params (the KL reference unless `grpo.kl_reference` is
      "round_start", which copies `start_model`'s).
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
    if cfg.grpo.kl_reference == "round_start":
      # A copy: the train state (and so `params`) is donated to the step.
      ref_params = jax.tree.map(jnp.copy, params)
    self.frozen = {"rest": self.rest,
                   "ref_params": ref_params if self.loss_cfg.kl_coef > 0 else None}
    # On the mesh from the start (multi-host: global arrays), so a restore lands there too.
    placed = step_shardings(self.state, {}, self.frozen, self.optimizer, self.mesh, self.rules)
    self.state, self.frozen = multihost.place((self.state, self.frozen),
                                              (placed.state, placed.frozen))
    self.max_len = cfg.rollout.limits.max_context_tokens or cfg.rollout.jax.max_len
    self.agent_loop = AgentLoop(
        server.engine, chat, task_environments(workspace_root, SandboxLimits(**cfg.sandbox.to_dict()),
                                               cache_dir=workspace_root / "boundary_cache"),
        sampling=SamplingParams(**cfg.rollout.sampling.to_dict()),
        limits=RolloutLimits(**cfg.rollout.limits.to_dict()))

  # -- pieces --------------------------------------------------------------------------------

  def _old_logp(self, params, input_ids):
    return _acting_logp(self.graphdef, self.loss_cfg.logprob_chunk_size,
                        self.loss_cfg.temperature, params, self.rest, input_ids)

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
    acting = nnx.merge(self.graphdef, multihost.local_copy(self.state.params), self.rest)
    version = f"round{self.round_index}-step{step}"
    # Multi-host SGLang: process 0 exports to the shared directory before the others load it.
    multihost.primary_first(f"serve {version}", lambda: self.server.load(acting, version))
    self.server.reseed(derive_seed("rollout", self.cfg.seed, self.round_index, step) & 0x7FFFFFFF)

  def update(self, trajectories: list[Trajectory]) -> dict[str, float]:
    """One GRPO step on one batch of rollouts; returns its metrics.

    The old-logprob pass runs every step, so `sampler_gap` (trainer vs sampler logprobs of the
    same tokens) is logged even when the update itself is skipped for lack of signal.
    """
    longest = multihost.agree_max(max(len(t.token_ids) for t in trajectories))
    batch, stats = rollout_batch(trajectories, max_len=self.max_len, cfg=self.loss_cfg,
                                 pad_id=self.chat.endoftext_id, longest=longest)
    signal = multihost.agree_any(np.any(batch["advantages"]))
    stats = multihost.combine_stats(stats)
    shardings = {k: sharding.batch_sharding(self.mesh, v.ndim) for k, v in batch.items()}
    batch = multihost.global_batch(batch, shardings)
    skipped_before = int(self.state.skipped)
    batch["old_logp"] = jax.device_put(
        self._old_logp(self.state.params, jnp.asarray(batch["input_ids"])),
        sharding.batch_sharding(self.mesh, 2))
    stats.update(sampler_gap(batch["old_logp"], batch))
    if signal:
      self.state, metrics = self._compiled_step(batch)(self.state, batch, self.frozen)
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
      metrics["no_signal"] = 0.0
    else:
      # Every group's rewards are tied (or dropped), so the policy term is exactly zero; only
      # the KL term would remain, and AdamW would rescale its ~1e-8 gradient into lr-sized
      # steps that drift the policy with no learning signal. The data still moves on.
      self.state = self.state.replace(step=self.state.step + 1)
      metrics = {"loss": 0.0, "grad_norm": 0.0, "update_applied": 0.0, "no_signal": 1.0}
    if not all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm")):
      raise FloatingPointError(f"round {self.round_index} step {int(self.state.step)}: "
                               f"non-finite GRPO update (loss {metrics['loss']}, grad_norm "
                               f"{metrics['grad_norm']})")
    return {**stats, **metrics,
            "skipped_now": float(int(self.state.skipped) - skipped_before)}

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
        items = multihost.split_groups([RolloutItem.from_row(r) for r in rows],  # this process's
                                       key=lambda item: item.state_id)           # state_ids
        trajectories = self.agent_loop.run(items, cfg.grpo.group_size)
        self.server.rollouts_done()  # SGLang may free its GPU memory for the train step
        t1 = time.monotonic()
        record = self.update(trajectories)
        step = int(self.state.step)
        seconds["rollout"] += t1 - t0
        seconds["update"] += time.monotonic() - t1
        record = {"step": step, **record}
        history.append(record)
        if on_step is not None:
          on_step(step, record)
        if step % cfg.grpo.checkpoint.every == 0 or step == steps:
          ckpt.save(step, self.state, data_state=reader.get_state(),
                    outer_state={"round": self.round_index, "steps": history, "seconds": seconds})
    nnx.update(self.model, multihost.local_copy(self.state.params))
    healthy = all(r["skipped_now"] == 0 for r in history)
    return RoundOutcome(params=self.state.params, steps=history, seconds=seconds,
                        healthy=healthy)
