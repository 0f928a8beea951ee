"""The run's training programs from its config: mesh, optimizer, GRPO loss, step and logprob
pass, and the GRPO `Trainer` built from them.

The BiCuRL round (`bat_jax.bicurl.grpo_round`), the memory plan (`bat_jax.memory_plan`) and the
GPU check (`experiments/gpu/`) build the same programs from the same config through these, so a
planned or measured step is the run's own. Only the model, the trainer and the loss are imported:
no rollout, sandbox or data-pipeline packages, so the GPU check runs on a box that has only
jax, torch and transformers plus a few pure-Python wheels.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np
from flax import nnx

from bat_jax import sharding
from bat_jax.grpo import GrpoConfig, grpo_loss_fn
from bat_jax.run_config import RunConfig
from bat_jax.stagebank.rounds import derive_seed
from bat_jax.train import (LogprobPassConfig, OptimizerConfig, StepConfig, Trainer,
                           TrainerConfig, split_model)


def run_mesh(cfg: RunConfig) -> jax.sharding.Mesh:
  """The config's mesh; with every axis size given, over the first that many devices."""
  sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  devices = None if -1 in sizes else jax.devices()[:int(np.prod(sizes))]
  return sharding.make_mesh(*sizes, devices=devices)


def optimizer_config(section: ml_collections.ConfigDict, total_steps: int) -> OptimizerConfig:
  """AdamW settings of the `sft` or `grpo` section."""
  return OptimizerConfig(learning_rate=section.lr, schedule=section.schedule,
                         warmup_steps=section.warmup_steps, total_steps=total_steps,
                         weight_decay=section.weight_decay, max_grad_norm=section.max_grad_norm,
                         eps=section.adam_eps)


def grpo_config(cfg: RunConfig) -> GrpoConfig:
  g = cfg.grpo
  return GrpoConfig(advantage_mode=g.advantage.mode, std_normalize=g.advantage.std_normalize,
                    credit=g.advantage.credit, credit_discount=g.advantage.credit_discount,
                    clip_low=g.clip_low, clip_high=g.clip_high, dual_clip=g.dual_clip,
                    kl_coef=g.kl_coef, kl_estimator=g.kl_estimator, loss_agg=g.loss_agg,
                    tis_cap=g.tis_cap, temperature=cfg.rollout.sampling.temperature,
                    # seq-mean-token-sum-norm's constant (ignored by the other aggregations).
                    norm_length=g.loss_norm_length or cfg.rollout.limits.max_response_tokens,
                    logprob_chunk_size=g.logprob_chunk_size,
                    logprob_save_probs=g.logprob_save_probs, pg_min_entropy=g.pg_min_entropy,
                    pg_prob_weight=g.pg_prob_weight)


def step_config(section: ml_collections.ConfigDict,
                trainer: ml_collections.ConfigDict) -> StepConfig:
  """Micro-batches and remat of the `sft` or `grpo` section; weight dtype of `trainer`."""
  return StepConfig(section.micro_batches, section.remat, trainer.weight_dtype)


def logprob_pass_config(cfg: RunConfig) -> LogprobPassConfig:
  """The old-policy / reference pass: the GRPO step's micro-batches, chunk and weight dtype."""
  return LogprobPassConfig(num_micro_batches=cfg.grpo.micro_batches,
                           chunk_size=cfg.grpo.logprob_chunk_size,
                           temperature=cfg.rollout.sampling.temperature,
                           weight_dtype=cfg.trainer.weight_dtype)


def grpo_trainer(cfg: RunConfig, model: nnx.Module, mesh: jax.sharding.Mesh,
                 round_index: int = 0, **kw) -> Trainer:
  """The GRPO `Trainer` of a round (fresh optimizer; compiled programs shared across rounds);
  `kw` goes to `Trainer` (e.g. `compiler_options`)."""
  loss_cfg = grpo_config(cfg)
  optimizer_cfg = optimizer_config(cfg.grpo, cfg.grpo.steps_per_round)
  step_cfg = step_config(cfg.grpo, cfg.trainer)
  trainer_cfg = TrainerConfig(
      optimizer=optimizer_cfg, step=step_cfg,
      seed=derive_seed("grpo", cfg.seed, round_index) & 0x7FFFFFFF,
      checkpoint_every=cfg.grpo.checkpoint.every, keep_checkpoints=cfg.grpo.checkpoint.keep)
  rules = tuple(cfg.sharding.rules)
  graphdef = split_model(model)[0]
  return Trainer.for_model(model, grpo_loss_fn(loss_cfg), trainer_cfg, mesh, rules,
                           cache_key=(graphdef, loss_cfg, optimizer_cfg, step_cfg, mesh, rules),
                           **kw)
