"""The shared trainer: the step (`step`), forward-only logprob passes and the `Trainer`."""

from bat_jax.train.logprob_pass import LogprobPassConfig, build_logprob_fn
from bat_jax.train.step import (REMAT_POLICIES, SCHEDULES, Batch, LossFn, OptimizerConfig,
                                RematPolicy, StepConfig, StepShardings, TrainState,
                                build_step_fn, cast_floating, init_train_state,
                                make_optimizer, make_schedule, make_train_step, memory_report,
                                split_micro_batches, split_model, step_shardings,
                                train_state_shardings)
from bat_jax.train.trainer import BatchSource, Trainer, TrainerConfig

__all__ = ["REMAT_POLICIES", "SCHEDULES", "Batch", "BatchSource", "LogprobPassConfig", "LossFn",
           "OptimizerConfig", "RematPolicy", "StepConfig", "StepShardings", "TrainState",
           "Trainer", "TrainerConfig", "build_logprob_fn", "build_step_fn", "cast_floating",
           "init_train_state", "make_optimizer", "make_schedule", "make_train_step",
           "memory_report", "split_micro_batches", "split_model", "step_shardings",
           "train_state_shardings"]
