"""An even smaller override of `configs/tiny.py:smoke` for the BiCuRL tests (CPU, seconds)."""

from __future__ import annotations

from configs import tiny

# Two layers (one DeltaNet, one attention) keep compile time down; a 2k vocab keeps prompts
# (~750 tokens) under the short SFT / rollout lengths.
FAST_OVERRIDES = {
    "mesh.data": 1,
    "tokenizer.train.vocab_size": 2048,
    "tokenizer.train.corpus_tasks": 7,
    "model.hf_config.hidden_size": 32,
    "model.hf_config.intermediate_size": 64,
    "model.hf_config.num_hidden_layers": 2,
    "model.hf_config.layer_types": ("linear_attention", "full_attention"),
    "sft.steps": 2,
    "sft.global_batch_size": 2,
    "sft.num_examples": 8,
    "sft.max_seq_len": 1024,
    "sft.max_validation_examples": 1,
    "sft.checkpoint.every": 1,
    "grpo.rounds": 2,
    "grpo.steps_per_round": 2,
    "grpo.prompt_groups": 2,
    "grpo.group_size": 2,
    "grpo.checkpoint.every": 1,
    "grpo.logprob_chunk_size": 256,
    "rollout.limits.max_turn_tokens": 8,
    "rollout.limits.max_assistant_turns": 2,
    "rollout.limits.max_tool_calls": 1,
    "rollout.limits.max_response_tokens": 16,
    "rollout.limits.max_context_tokens": 1024,
    "rollout.jax.batch_size": 8,
    "rollout.jax.max_len": 1024,
    "rollout.jax.prefill_chunk": 256,
    "stagebank.n_batches": 1,
    "evaluator.workers": 7,
    "logging.progress": False,
}


def fast_config(**overrides):
  """`tiny:smoke` with FAST_OVERRIDES and then `overrides` (dotted names with `__` for `.`)."""
  cfg = tiny.get_config("smoke")
  cfg.update_from_flattened_dict(FAST_OVERRIDES)
  cfg.update_from_flattened_dict({k.replace("__", "."): v for k, v in overrides.items()})
  return cfg
