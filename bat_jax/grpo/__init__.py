"""GRPO: pure advantage estimators and losses, chunked logprobs, the shared train step."""

from bat_jax.grpo.advantages import ADVANTAGE_ESTIMATORS, group_advantages
from bat_jax.grpo.logprobs import chunked_logprobs, taken_token_logprobs
from bat_jax.grpo.loss import (KL_ESTIMATORS, LOSS_AGGREGATIONS, finalize_stats, policy_loss,
                               policy_loss_terms)
from bat_jax.grpo.objective import GrpoConfig, grpo_loss_fn
from bat_jax.grpo.train_step import (REMAT_POLICIES, SCHEDULES, OptimizerConfig, StepConfig,
                                     StepShardings, TrainState, build_step_fn, compile_step,
                                     init_train_state, make_optimizer, make_train_step,
                                     memory_report, split_model, step_shardings,
                                     train_state_shardings)
