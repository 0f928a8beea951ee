"""GRPO: pure advantage estimators and losses, chunked logprobs, the GRPO objective.

The train step and trainer shared with SFT live in `bat_jax.train`.
"""

from bat_jax.grpo.advantages import ADVANTAGE_ESTIMATORS, group_advantages
from bat_jax.grpo.logprobs import chunked_logprobs, taken_token_logprobs
from bat_jax.grpo.loss import (KL_ESTIMATORS, LOSS_AGGREGATIONS, finalize_stats,
                               policy_loss_terms, safe_divide)
from bat_jax.grpo.objective import GrpoConfig, grpo_loss_fn

__all__ = ["ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "GrpoConfig",
           "chunked_logprobs", "finalize_stats", "group_advantages", "grpo_loss_fn",
           "policy_loss_terms", "safe_divide", "taken_token_logprobs"]
