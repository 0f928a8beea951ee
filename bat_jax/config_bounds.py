"""The valid range of every numeric config field, in one table, checked at start-up.

`BOUNDS` maps a dotted config path (or an `fnmatch` pattern: `model.hf_config.*`,
`sft.bucket_lengths[*]`) to its closed / open interval and why; `bound_problems(cfg)` checks
every int / float leaf of a config against it, one `config.<path>: ...` line per value out of
range (`bat_jax.config_validation.field_problems` runs it after the field-specific checks).
The ranges are sanity limits: generous for any real run, but they refuse the absurd (a 2^50 MB
sandbox, a 1e300 s wall clock, logging every 0 steps). `tests/configs/test_bad_values.py`
checks that every numeric leaf of every config in `configs/` has an entry, and that a value just
outside each bound is refused naming its field. `python -m bat_jax.config_bounds` prints the
table as markdown.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any, Iterator, Mapping, Optional

from ml_collections import ConfigDict

INT63 = 2**63 - 1
K, M = 2**10, 2**20
DAY = 86_400.0


@dataclasses.dataclass(frozen=True)
class Bound:
  """`lo <= v <= hi` (`lo < v` / `v < hi` where open); None: unbounded on that side."""
  lo: Optional[float]
  hi: Optional[float]
  why: str
  lo_open: bool = False
  hi_open: bool = False

  def contains(self, v: float) -> bool:
    return ((self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)) and
            (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)))

  def text(self) -> str:
    lo = "-inf" if self.lo is None else _num(self.lo)
    hi = "inf" if self.hi is None else _num(self.hi)
    return f"{'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


def _num(x: float) -> str:
  if x == INT63:
    return "2^63 - 1"
  return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def _count(hi: float, why: str, lo: float = 1) -> Bound:
  return Bound(lo, hi, why)


def _positive(hi: float, why: str) -> Bound:
  return Bound(0, hi, why, lo_open=True)


_SEED = Bound(0, INT63, "a non-negative int64 seed")
_LR = _positive(1.0, "a learning rate")
_STEPS = _count(1e8, "a step count")
_FRACTION_OPEN = Bound(0, 1, "a fraction of memory", lo_open=True)
_DROP = Bound(0, 1, "a score drop (scores are in [0, 1])")
_TIMEOUT = _positive(7 * DAY, "seconds (a week at most)")
_TOKENS = _count(16 * M, "tokens")
_HF_SIZE = _count(1 * M, "a model dimension or count")

BOUNDS: Mapping[str, Bound] = {
    "seed": _SEED, "stagebank.seed": _SEED, "evaluator.seed": _SEED,
    # mesh: -1 takes the devices left over; 0 is refused by the mesh check.
    "mesh.data": Bound(-1, 64 * K, "devices (-1: the rest)"),
    "mesh.fsdp": Bound(-1, 64 * K, "devices (-1: the rest)"),
    "mesh.tensor": Bound(-1, 64 * K, "devices (-1: the rest)"),
    "distributed.num_processes": _count(64 * K, "processes"),
    "distributed.process_id": Bound(0, 64 * K, "a process index"),
    "distributed.xla_mem_fraction": _FRACTION_OPEN,
    "trainer.keep_rounds": _count(10_000, "rounds kept"),
    "memory.device_gib": _positive(4096, "GiB per device"),
    "memory.rollout_reserved_gib": Bound(0, 4096, "GiB"),
    "memory.jax_context_gib": Bound(0, 4096, "GiB per device: JAX/CUDA/NCCL contexts"),
    "memory.rollout_activation_gib": Bound(0, 4096, "GiB per device: rollout activations"),
    "memory.headroom_gib": Bound(0, 4096, "GiB each phase must leave free"),
    "model.hf_config.rms_norm_eps": Bound(0, 1, "an epsilon", lo_open=True, hi_open=True),
    "model.hf_config.initializer_range": _positive(1.0, "an init std"),
    "model.hf_config.rope_parameters.partial_rotary_factor": _positive(1.0, "a fraction"),
    "model.hf_config.rope_parameters.rope_theta": _positive(1e12, "a RoPE base"),
    "model.hf_config.max_position_embeddings": _TOKENS,
    "model.hf_config.*": _HF_SIZE,
    "tokenizer.train.vocab_size": _count(16 * M, "tokens in the vocabulary"),
    "tokenizer.train.corpus_tasks": _count(1e7, "task instances"), "tokenizer.train.seed": _SEED,
    # sft
    "pretrain.echo_steps": Bound(0, 1e8, "steps"), "pretrain.steps": _STEPS,
    "pretrain.batch_size": _count(1 * M, "rows per step"),
    "pretrain.echo_batch_size": _count(1 * M, "rows per step"),
    "pretrain.echo_seq_len": _TOKENS,
    "pretrain.echo_long_steps": Bound(0, 1e8, "steps"),
    "pretrain.echo_long_batch_size": _count(1 * M, "rows per step"),
    "pretrain.echo_long_seq_len": _TOKENS,
    "pretrain.seq_len": _TOKENS, "pretrain.lr": _LR,
    "pretrain.extend_steps": Bound(0, 1e8, "steps"),
    "pretrain.extend_batch_size": _count(1 * M, "rows per step"),
    "pretrain.extend_seq_len": _TOKENS, "pretrain.extend_lr": _LR,
    "pretrain.warmup_steps": Bound(0, 1e8, "steps"), "pretrain.seed": _SEED,
    "pretrain.probes": _count(1e5, "probe documents"),
    "pretrain.probe_depth": Bound(0, 1e6, "tokens"),
    "pretrain.checkpoint_every": _count(1e8, "steps"),
    "sft.steps": _STEPS, "sft.warmup_steps": Bound(0, 1e8, "steps"),
    "sft.global_batch_size": _count(1 * M, "rows per step"),
    "sft.micro_batches": _count(64 * K, "accumulation steps"),
    "sft.max_seq_len": _TOKENS, "sft.bucket_lengths[*]": _TOKENS,
    "sft.lr": _LR, "sft.weight_decay": Bound(0, 10, "AdamW decay"),
    "sft.max_grad_norm": _positive(1e6, "a gradient norm"),
    "sft.adam_eps": _positive(1e3, "AdamW's epsilon"),
    "sft.validation_fraction": Bound(0, 1, "a fraction of the rows", hi_open=True),
    "sft.max_validation_examples": Bound(0, 1e7, "examples (0: no validation NLL)"),
    "sft.num_examples": _count(1e9, "rows"),
    "sft.first_action_tasks": Bound(0, 1e6, "tasks per grid state"),
    "sft.e2e_tasks": Bound(0, 1e6, "tasks per (track, outcome)"),
    "sft.reaction_tasks": Bound(0, 1e6, "tasks per (track, outcome)"),
    "sft.decision_balance": Bound(0, 1, "a balance exponent"),
    "sft.context_loss_weight": Bound(0, 100, "a loss weight"),
    "sft.checkpoint.every": _STEPS, "sft.checkpoint.keep": _count(10_000, "checkpoints"),
    # grpo
    "grpo.rounds": _count(10_000, "rounds"), "grpo.steps_per_round": _STEPS,
    "grpo.prompt_groups": _count(1 * M, "state_id groups per update"),
    "grpo.group_size": _count(4096, "continuations per group (a group of one has no "
                              "advantage)", lo=2),
    "grpo.lr": _LR, "grpo.warmup_steps": Bound(0, 1e8, "steps"),
    "grpo.weight_decay": Bound(0, 10, "AdamW decay"),
    "grpo.kl_coef": Bound(0, 100, "a loss weight"),
    "grpo.advantage.credit_discount": Bound(0, 1, "a per-stage discount"),
    "grpo.failed_call_penalty": Bound(0, 10, "reward per failed call or malformed turn"),
    "grpo.loss_norm_length": _TOKENS,
    "grpo.clip_low": Bound(0, 1, "a ratio clip (1 - clip_low must stay >= 0)"),
    "grpo.clip_high": Bound(0, 100, "a ratio clip"),
    "grpo.dual_clip": Bound(1, 1e6, "a loss cap multiple (> 1)", lo_open=True),
    "grpo.tis_cap": _positive(1e6, "an importance weight cap"),
    "grpo.pg_min_entropy": Bound(0, 50, "an entropy in nats"),
    "grpo.pg_prob_weight": Bound(0, 1, "a weight between the log-probability and probability gradients"),
    "grpo.max_grad_norm": _positive(1e6, "a gradient norm"),
    "grpo.adam_eps": _positive(1e3, "AdamW's epsilon"),
    "grpo.micro_batches": _count(64 * K, "accumulation steps"),
    "grpo.logprob_chunk_size": _TOKENS,
    "grpo.checkpoint.every": _STEPS, "grpo.checkpoint.keep": _count(10_000, "checkpoints"),
    # rollout
    "rollout.sampling.temperature": _positive(100, "a sampling temperature"),
    "rollout.sampling.top_p": _positive(1.0, "a probability mass"),
    "rollout.sampling.top_k": Bound(-1, 16 * M, "tokens (-1: off)"),
    "rollout.limits.max_assistant_turns": _count(10_000, "turns"),
    "rollout.limits.max_tool_calls": Bound(0, 10_000, "calls"),
    "rollout.limits.max_response_tokens": _TOKENS,
    "rollout.limits.max_observation_chars": _count(64 * M, "characters"),
    "rollout.limits.max_turn_tokens": _TOKENS,
    "rollout.limits.max_code_chars": _count(64 * M, "characters"),
    "rollout.limits.max_context_tokens": _TOKENS,
    "rollout.max_concurrent_trajectories": _count(1 * M, "trajectories"),
    "rollout.jax.batch_size": _count(64 * K, "rows decoded together"),
    "rollout.jax.max_len": _TOKENS, "rollout.jax.prefill_chunk": _TOKENS,
    "rollout.sglang.port": Bound(0, 65535, "a TCP port (0: any free one)"),
    "rollout.sglang.mem_fraction_static": _FRACTION_OPEN,
    "rollout.sglang.tp_size": _count(1024, "devices"),
    "rollout.sglang.dp_size": _count(1024, "replicas"),
    "rollout.sglang.startup_timeout_s": _TIMEOUT,
    "rollout.sglang.request_timeout_s": _positive(DAY, "seconds (a day at most)"),
    "rollout.sglang.max_retries": Bound(0, 100, "retries"),
    "rollout.sglang.release_timeout_s": _TIMEOUT,
    "rollout.sglang.export_threads": _count(64, "files written at once"),
    # sandbox: per tool call
    "sandbox.wall_s": _positive(DAY, "seconds per call (a day at most)"),
    "sandbox.cpu_s": _count(DAY, "CPU seconds per call"),
    "sandbox.memory_mb": _count(1 * M, "MiB (1 TiB at most)"),
    "sandbox.max_procs": _count(64 * K, "processes"),
    "sandbox.max_output_bytes": _count(4 * 2**30, "bytes (4 GiB at most)"),
    "sandbox.max_workspace_mb": _count(1 * M, "MiB (1 TiB at most)"),
    # services
    "stagebank.n_batches": _count(1e7, "batches per round view"),
    "stagebank.request_timeout_s": _TIMEOUT,
    "stagebank.workers": _count(1024, "threads"),
    "evaluator.cells_per_track": _count(100_000, "cells"),
    "evaluator.heldback_cells_per_track": _count(100_000, "cells (0: none)", lo=0),
    "evaluator.workers": _count(1024, "processes"),
    "evaluator.external.timeout_s": _TIMEOUT,
    "curriculum.temperature": _positive(100, "a softmin temperature"),
    "curriculum.pool_mix.*": Bound(0, 10_000, "relative pool size"),
    "gate.max_overall_drop": _DROP, "gate.max_task_drop": _DROP,
    "gate.max_track_drop": _DROP, "gate.max_stage_drop": _DROP,
    "gate.catastrophic_overall_drop": _DROP,
    "gate.tolerance": Bound(0, 0.01, "float slack at the gate's boundaries"),
    "gate.track_noise_z": Bound(0, 10, "paired standard errors added to a track's limit"),
    "logging.log_every_steps": _count(1e9, "steps between log lines"),
}


def bound_for(path: str) -> Optional[Bound]:
  """The entry for `path`: the exact one, then its tuple's (`a.b[3]` -> `a.b[*]`), else the
  first pattern that matches."""
  element = path.split("[")[0] + "[*]" if path.endswith("]") else path
  for key in (path, element):
    if key in BOUNDS:
      return BOUNDS[key]
  return next((b for p, b in BOUNDS.items() if p.endswith(".*") and fnmatch.fnmatchcase(path, p)),
              None)


def numeric_leaves(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
  """`(dotted path, value)` of every int / float field, tuple elements (`a.b[0]`) and typed
  None placeholders included (bools excluded)."""
  if isinstance(node, ConfigDict):
    for key in node.keys():
      child = f"{path}.{key}" if path else key
      value = node[key]
      if value is None and node.get_type(key) in (int, float):
        yield child, None
      else:
        yield from numeric_leaves(value, child)
  elif isinstance(node, dict):
    for key, value in node.items():
      yield from numeric_leaves(value, f"{path}.{key}" if path else str(key))
  elif isinstance(node, (list, tuple)):
    for i, value in enumerate(node):
      yield from numeric_leaves(value, f"{path}[{i}]")
  elif isinstance(node, (int, float)) and not isinstance(node, bool):
    yield path, node


def bound_problems(cfg: ConfigDict, skip: frozenset[str] = frozenset()) -> list[str]:
  """`config.<path>: ...` for every numeric value outside its documented range (paths in
  `skip` already have a problem reported; unset placeholders are not checked)."""
  problems = []
  for path, value in numeric_leaves(cfg):
    bound = bound_for(path)
    if value is None or bound is None or path in skip:
      continue
    if isinstance(value, float) and not math.isfinite(value):
      continue  # reported as non-finite by the generic number check
    if not bound.contains(value):
      problems.append(f"config.{path}: {value!r} is outside its valid range {bound.text()} "
                      f"({bound.why})")
  return problems


def markdown_table() -> str:
  lines = ["| field | valid range | what it is |", "|---|---|---|"]
  lines += [f"| `{p}` | {b.text()} | {b.why} |" for p, b in BOUNDS.items()]
  return "\n".join(lines)


if __name__ == "__main__":
  print(markdown_table())
