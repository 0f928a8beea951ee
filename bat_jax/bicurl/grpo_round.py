"""One GRPO round: Stage Bank batches -> G rollouts per state_id -> rubric rewards -> update.

The round starts from the last promoted policy with a fresh optimizer, keeps the SFT policy
(`grpo.kl_reference = "sft"`) or the round's start policy (`"round_start"`) as the KL reference
(a `trainer.reference_dtype` copy whose logprobs come from their own pass and enter the step as
`ref_logp`), and checkpoints (orbax: train state, round-reader position, the
round's step log and phase times) every `grpo.checkpoint.every` steps. The shared
`bat_jax.train.Trainer` owns the state, the compiled programs and the resume loop; this module
supplies the loss and the batches (`RoundBatches`). Rollouts are replayable: before step
k the engine gets the params of step k, and every turn samples with a seed derived from
(seed, round, k, its state_id, continuation and turn), so a run killed mid-round and restarted
reproduces the same trajectories and the same params however the turns were batched.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax import workflow
from bat_jax.run_config import RunConfig
from bat_jax.bicurl import multihost
from bat_jax.bicurl.policy import worker_step_tokens
from bat_jax.grpo import GrpoConfig, group_advantages
from bat_jax.grpo.advantages import stage_credit, valid_group_members
from bat_jax.grpo.loss import sampler_gap_stats
from bat_jax.train import Trainer, TrainState, placement
# The programs' builders live in bat_jax.run_programs (light imports: the memory plan and the
# GPU check use them); the loop and the tests take them from here too.
from bat_jax.run_programs import (grpo_config, grpo_trainer, logprob_pass_config,  # noqa: F401
                                  optimizer_config, run_mesh, step_config)
from bat_jax.rollout import AgentLoop, RolloutItem, Trajectory, collate, task_environments
from bat_jax.stagebank.reader import RoundReader
from bat_jax.stagebank.rounds import derive_seed
from bat_jax.stagebank.shards import round_dirname
from bat_jax.model.chat_format import ChatFormat

log = logging.getLogger(__name__)

MIN_BUCKET = 128


def bucket_length(longest: int, cap: int) -> int:
  """Padded batch length: the next power of two or 1.5x power of two (>= MIN_BUCKET), at most
  `cap`, so a round compiles a few step shapes rather than one per batch. The half steps cap
  padding at 1.5x the longest row (2x with powers alone): tiny-config rollouts of ~1,400
  tokens pad to 1,536, not 2,048."""
  power = 1 << max(0, math.ceil(math.log2(max(longest, 1))))
  half_step = 3 * power // 4
  length = half_step if longest <= half_step else power
  return min(cap, max(MIN_BUCKET, length))


def failed_turns(trajectories: list[Trajectory]) -> np.ndarray:
  """[N] per trajectory: tool calls that exited non-zero plus turns that did not parse."""
  return np.asarray([t.num_failed_calls + t.num_malformed for t in trajectories], np.float32)


def stage_stop_turns(trajectories: list[Trajectory], loss_mask: np.ndarray) -> np.ndarray:
  """`[B, T]` 1 on the closing no-call turn of each stage-local trajectory that ended by
  stopping (`agent_stop`): the last run of generated tokens. The row was cut at a stage
  boundary, so stopping there is where the cut falls, not a skill of the stage; in an E2E
  episode the same observation asks for the next stage's call."""
  closing = np.zeros_like(loss_mask)
  for i, t in enumerate(trajectories):
    if t.focus == workflow.E2E or t.finish_reason != "agent_stop":
      continue
    generated = np.flatnonzero(loss_mask[i] > 0)
    if generated.size == 0:
      continue
    end = generated[-1] + 1
    before = np.flatnonzero(loss_mask[i, :end] == 0)  # the turn starts after its last gap
    closing[i, (before[-1] + 1 if before.size else 0):end] = 1
  return closing


def turn_stage_index(trajectory: Trajectory, length: int) -> np.ndarray:
  """`[T]` the stage index (into `workflow.STAGES`) each generated token's turn answers for,
  -1 elsewhere. A turn with a stage call answers for that stage; one without (a stop, a
  malformed turn) for the stage after the last call's, the step it failed to take (a stop after
  validation answers for S4)."""
  index = np.full(length, -1, np.int32)
  last = -1
  for start, end, stage in trajectory.turn_spans:
    if stage is not None:
      last = here = workflow.STAGES.index(stage)
    else:
      here = min(last + 1, len(workflow.STAGES) - 1)
    index[min(start, length):min(end, length)] = here
  return index


def stage_credit_advantages(trajectories: list[Trajectory], outcome: np.ndarray,
                            group_ids: np.ndarray, valid: np.ndarray, length: int,
                            cfg: GrpoConfig) -> np.ndarray:
  """`[B, T]` per-token advantages (`grpo.advantage.credit = "stage"`): an E2E row's turns get
  their stage's advantage-to-go (`stage_credit` over `workflow.e2e_stage_rewards`); a
  stage-local row has one stage, so every token keeps its `outcome` advantage `[B]`."""
  per_token = np.repeat(outcome[:, None], length, axis=1).astype(np.float32)
  e2e = np.asarray([t.focus == workflow.E2E for t in trajectories])
  if not e2e.any():
    return per_token
  rewards = np.asarray([workflow.e2e_stage_rewards(t.stage_scores, t.task_score) if is_e2e
                        else (0.0,) * len(workflow.STAGES)
                        for t, is_e2e in zip(trajectories, e2e)], np.float32)
  to_go = np.asarray(stage_credit(rewards, group_ids, valid=valid & e2e,
                                  discount=cfg.credit_discount, mode=cfg.advantage_mode,
                                  std_normalize=cfg.std_normalize))          # [B, S]
  for i in np.flatnonzero(e2e):
    stage = turn_stage_index(trajectories[i], length)
    per_token[i] = np.where(stage >= 0, to_go[i, np.maximum(stage, 0)], 0.0)
  return per_token


def rollout_batch(trajectories: list[Trajectory], *, max_len: int, cfg: GrpoConfig,
                  pad_id: int, longest: Optional[int] = None, failed_call_penalty: float = 0.0,
                  train_stage_stop: bool = True
                  ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """The GRPO batch (less `old_logp`) and rollout statistics.

  Errored and aborted trajectories (`Trajectory.trainable` False) are infrastructure failures,
  not policy behaviour: they get loss mask 0 and stay out of their group's baseline. A group
  left with fewer than 2 trainable members has no baseline and is dropped (mask 0). Rows are
  kept (zeroed, not removed) so the batch shape, and hence the compiled step, stays the same.
  Advantages are computed within each state_id's group only (`group_advantages`). `longest`
  (default: of these trajectories) sets the padded length, so processes can agree on one.

  `failed_call_penalty` (`grpo.failed_call_penalty`) is subtracted from the rubric reward for
  each failed call or malformed turn before the advantages: the rubric scores what the
  workspace holds, so without it a stray failing call costs nothing. Built against the
  held-out `fix`-after-"validation ok" collapse, which it did not stop; the cause was elsewhere
  (experiments/README.md, "Values after a space" and "The KL anchor"). The logged reward stays
  the rubric's.

  With `cfg.credit == "stage"` the advantages are `[B, T]` (`stage_credit_advantages`), else
  `[B]`.

  `train_stage_stop` False (`grpo.train_stage_stop`) leaves the closing stop turn of
  stage-local rows out of the loss (`stage_stop_turns`).
  """
  longest = longest or max(len(t.token_ids) for t in trajectories)
  collated = collate(trajectories, max_len=bucket_length(longest, max_len), pad_id=pad_id)
  valid = collated["trainable"]
  members = np.asarray(valid_group_members(collated["group_ids"], valid))
  keep = valid & (members >= 2)
  failed = failed_turns(trajectories)
  trained = collated["rewards"] - failed_call_penalty * failed
  advantages = np.asarray(group_advantages(trained, collated["group_ids"],
                                           valid=valid, mode=cfg.advantage_mode,
                                           std_normalize=cfg.std_normalize))
  if cfg.credit == "stage":
    if failed_call_penalty:
      raise ValueError("failed_call_penalty is not defined with per-stage credit")
    advantages = stage_credit_advantages(trajectories, advantages, collated["group_ids"],
                                         valid, collated["input_ids"].shape[1], cfg)
  rewards = collated["rewards"][valid] if valid.any() else np.zeros(1, np.float32)
  reasons = [t.finish_reason for t in trajectories]
  dropped_groups = {g for g, v, n in zip(collated["group_ids"], valid, members) if n < 2}
  stats = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
           "reward_max": float(rewards.max()),
           "response_tokens": float(np.mean([t.num_response_tokens for t in trajectories])),
           "tool_calls": float(np.mean([t.num_tool_calls for t in trajectories])),
           "failed_turns": float(failed.mean()),
           "errors": float(reasons.count("error")), "aborted": float(reasons.count("aborted")),
           "excluded_trajectories": float((~keep).sum()),
           "dropped_groups": float(len(dropped_groups)), "length": float(longest),
           "stage_ends": float(reasons.count("stage_end"))}
  pools = np.asarray([t.pool for t in trajectories])
  for pool in workflow.POOLS:  # is the round's own practice learnt? (report.reward_by_pool)
    mine = valid & (pools == pool)
    if mine.any():
      stats[f"reward_{pool}"] = float(collated["rewards"][mine].mean())
  # The sampler's logprobs ride along for truncated IS and the sampler_gap metric.
  loss_mask = collated["loss_mask"] * keep[:, None].astype(np.float32)
  if not train_stage_stop:
    loss_mask = loss_mask * (1.0 - stage_stop_turns(trajectories, collated["loss_mask"]))
  return {"input_ids": collated["input_ids"], "valid": collated["valid"],
          "loss_mask": loss_mask,
          "advantages": np.where(keep if advantages.ndim == 1 else keep[:, None], advantages,
                                 0.0).astype(np.float32),
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


@dataclasses.dataclass
class RoundOutcome:
  """What a finished round hands back to the outer loop."""
  steps: list[dict[str, float]]  # per-step metrics
  seconds: dict[str, float]      # rollout / update wall time
  healthy: bool


StepHook = Callable[[int, dict[str, float]], None]


class RoundBatches:
  """The trainer's batch source for one round: serve the current params, roll out, score, add
  `valid`, the old-policy and reference logprobs; its step log is the checkpoint's outer item."""

  def __init__(self, grpo: "GrpoRound", reader: RoundReader):
    self.grpo, self.reader = grpo, reader
    self.history: list[dict[str, float]] = []
    self.seconds = {"rollout": 0.0, "update": 0.0}
    self._stats: dict[str, float] = {}
    self._t_update = 0.0

  def next_batch(self, trainer: Trainer, state: TrainState) -> Optional[dict[str, Any]]:
    g = self.grpo
    rows = next(self.reader)
    t0 = time.monotonic()
    g.serve(state.params, int(state.step))
    items = multihost.split_groups([RolloutItem.from_row(r) for r in rows],  # this process's
                                   key=lambda item: item.state_id)           # state_ids
    trajectories = g.agent_loop.run(items, g.cfg.grpo.group_size,
                                    seed=g.rollout_seed(int(state.step)))
    g.server.rollouts_done()  # SGLang may free its GPU memory for the train step
    self._t_update = time.monotonic()
    self.seconds["rollout"] += self._t_update - t0
    batch, self._stats = g.prepare(trajectories, state.params)
    return batch

  def record(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
    if metrics:
      values = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
      values["no_signal"] = 0.0
    else:
      values = {"loss": 0.0, "grad_norm": 0.0, "update_applied": 0.0, "no_signal": 1.0}
    if not all(math.isfinite(values[k]) for k in ("loss", "grad_norm")):
      raise FloatingPointError(f"round {self.grpo.round_index} step {step}: non-finite GRPO "
                               f"update (loss {values['loss']}, grad_norm {values['grad_norm']})")
    self.seconds["update"] += time.monotonic() - self._t_update
    skipped_now = float(values.get("update_applied", 1.0) == 0.0 and not values["no_signal"])
    record = {"step": step, **self._stats, **values, "skipped_now": skipped_now}
    self.history.append(record)
    return record

  def get_state(self) -> Any:
    return self.reader.get_state()

  def outer_state(self) -> dict[str, Any]:
    return {"round": self.grpo.round_index, "steps": self.history, "seconds": self.seconds}

  def restore(self, data_state: Any, outer_state: dict[str, Any]) -> None:
    self.reader.set_state(data_state)
    self.history, self.seconds = outer_state["steps"], outer_state["seconds"]


class GrpoRound:
  """Runs the GRPO steps of one round (see the module docstring).

  Args:
    cfg: the run config.
    round_index: the round.
    start_model: the policy the round starts from (updated in place at the end).
    ref_params: the SFT policy's params (the KL reference unless `grpo.kl_reference` is
      "round_start", which uses `start_model`'s); unused when `grpo.kl_coef` is 0.
    server: the policy server rollouts are generated with (`bicurl.policy`).
    chat_format: the policy's chat format.
    checkpoint_dir: this round's orbax directory.
    workspace_root: where rollout workspaces are created.
  """

  def __init__(self, cfg: RunConfig, round_index: int, start_model: nnx.Module,
               ref_params: Any, server: Any, chat_format: ChatFormat, checkpoint_dir: Path,
               workspace_root: Path):
    self.cfg, self.round_index, self.server = cfg, round_index, server
    self.chat_format = chat_format
    self.model = start_model
    self.checkpoint_dir = checkpoint_dir
    self.loss_cfg = grpo_config(cfg)
    self.trainer = grpo_trainer(cfg, start_model, run_mesh(cfg), round_index)
    self.ref_params = None
    if self.loss_cfg.kl_coef > 0:
      round_start = cfg.grpo.kl_reference == "round_start"
      if round_start:  # the start params become the train state, which each step donates
        ref_params = nnx.state(start_model, nnx.Param)
      self.ref_params = self.trainer.reference_params(ref_params, cfg.trainer.reference_dtype,
                                                      copy=round_start)
    self.pass_cfg = logprob_pass_config(cfg)
    self.max_len = cfg.rollout.limits.max_context_tokens or cfg.rollout.jax.max_len
    self.agent_loop = AgentLoop(
        server.engine, chat_format,
        task_environments(workspace_root, cfg.sandbox,
                          cache_dir=workspace_root / "boundary_cache"),
        sampling=cfg.rollout.sampling, limits=cfg.rollout.limits,
        concurrency=max(1, cfg.rollout.max_concurrent_trajectories),
        step_tokens=worker_step_tokens(server.engine), stage_end=cfg.rollout.stage_end)

  def rollout_seed(self, step: int) -> int:
    """The sampler seed of step `step`'s rollouts: the same on a replay of the step."""
    return derive_seed("rollout", self.cfg.seed, self.round_index, step) & 0x7FFFFFFF

  def serve(self, params: Any, step: int) -> None:
    # The sharded train-state params themselves: every process calls `load` (multi-host, the
    # in-process engine takes its host's own copy, an export joins each leaf's spread).
    acting = nnx.merge(self.trainer.graphdef, params, self.trainer.rest)
    self.server.load(acting, f"{round_dirname(self.round_index)}-step{step}")
    self.server.reseed(self.rollout_seed(step))

  def prepare(self, trajectories: list[Trajectory], params: Any
              ) -> tuple[Optional[dict[str, Any]], dict[str, float]]:
    """The step's batch (None without signal) and the rollout statistics of `trajectories`.

    With `grpo.old_logp = "pass"` the old-logprob pass runs every step, so `sampler_gap`
    (trainer vs sampler logprobs of the same tokens) is logged even when the update is skipped
    for lack of signal; with "step" the update computes them itself (the loss's `sampler_gap`).
    """
    longest = multihost.agree_max(max(len(t.token_ids) for t in trajectories))
    batch, stats = rollout_batch(trajectories, max_len=self.max_len, cfg=self.loss_cfg,
                                 failed_call_penalty=self.cfg.grpo.failed_call_penalty,
                                 train_stage_stop=self.cfg.grpo.train_stage_stop,
                                 pad_id=self.chat_format.endoftext_id, longest=longest)
    signal = multihost.agree_any(np.any(batch["advantages"]))
    stats = multihost.combine_stats(stats)
    batch = placement.global_batch(batch, self.trainer.batch_shardings(batch))
    if self.cfg.grpo.old_logp == "pass":
      batch["old_logp"] = self.trainer.logprobs(params, batch, self.pass_cfg, "old_logp")
      stats.update(sampler_gap(batch["old_logp"], batch))
    if not signal:
      # Every group's rewards are tied (or dropped), so the policy term is exactly zero; only
      # the KL term would remain, and AdamW would rescale its ~1e-8 gradient into lr-sized
      # steps that drift the policy with no learning signal. The data still moves on.
      return None, stats
    if self.ref_params is not None:
      batch["ref_logp"] = self.trainer.logprobs(self.ref_params, batch, self.pass_cfg, "ref_logp")
    return batch, stats

  def run(self, round_dir: Path, on_step: Optional[StepHook] = None) -> RoundOutcome:
    """Trains `grpo.steps_per_round` steps on the round's batches, resuming if checkpointed."""
    steps = self.cfg.grpo.steps_per_round
    probe = RoundReader(round_dir)
    source = RoundBatches(self, RoundReader(round_dir,
                                            num_epochs=math.ceil(steps / probe.n_batches)))
    state = self.trainer.fit(self.checkpoint_dir, steps, source,
                             lambda: nnx.state(self.model, nnx.Param), on_step)
    nnx.update(self.model, state.params)  # sharded as trained; the export reads the shards
    healthy = all(r["skipped_now"] == 0 for r in source.history)
    return RoundOutcome(steps=source.history, seconds=source.seconds, healthy=healthy)
