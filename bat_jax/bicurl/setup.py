"""Run setup: the tokenizer, the policy model and the cold-start SFT examples.

Each function is idempotent: what it builds lands in the run directory atomically and is
reused on restart.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from bat_jax.run_config import RunConfig
from bat_jax import train_tasks, workflow
from bat_jax.model import chat_format as chat_format_lib
from bat_jax.model import compact_chat
from bat_jax.model import ModelConfig, build_model, load_pretrained
from bat_jax.model import tokenizer as tokenizer_lib
from bat_jax.model import tokenizer_corpus as corpus_lib
from bat_jax.config_validation import FROM_HF_CONFIG
from bat_jax.sft import Example, balanced_repeats, drop_too_long
from bat_jax.stagebank import grid, leakcheck, rl_rows, rounds, sft_rows, shards
from bat_jax.stagebank.build import load_matcher

log = logging.getLogger(__name__)


def model_dtypes(cfg: RunConfig) -> tuple[Any, Any]:
  """`(compute dtype, param dtype)` of the policy."""
  return jnp.dtype(cfg.model.dtype), jnp.dtype(cfg.model.param_dtype)


def model_type(cfg: RunConfig) -> str:
  """The policy's HF `model_type` (picks its chat format)."""
  if cfg.model.source in FROM_HF_CONFIG:
    return cfg.model.hf_config.model_type
  return ModelConfig.from_pretrained_dir(cfg.model.path).model_type


# --- tokenizer ---------------------------------------------------------------------------------

def tokenizer_corpus(num_tasks: int, seed: int, action_space: str = "code") -> list[str]:
  """Texts a from-scratch tokenizer is trained on: briefs, expert code and thoughts of
  `num_tasks` training task instances (tracks x outcomes round-robin), plus the chat markup
  samples of `tokenizer_corpus.tiny_corpus`."""
  docs = [rl_rows.SYSTEM_PROMPT, *corpus_lib.tiny_corpus(seed=seed)]
  cells = [(t, o) for o in workflow.OUTCOMES for t in workflow.TRACKS]
  for i in range(num_tasks):
    track, outcome = cells[i % len(cells)]
    instance = train_tasks.generate(track, rounds.derive_seed("tokenizer", seed, i) & 0x7FFFFFFF,
                                    outcome, action_space)
    docs += [train_tasks.brief_for(instance, focus) for focus in workflow.FOCI]
    for stage in workflow.STAGES:
      for action in train_tasks.expert_actions(instance, stage):
        docs += [action.get("thought", ""), action["arguments"]["code"]]
  return docs


def prepare_tokenizer(cfg: RunConfig, out_dir: Path) -> Path:
  """Trains (`tokenizer.source = train`) or copies the run's tokenizer into `out_dir`."""
  if all((out_dir / f).is_file() for f in tokenizer_lib.TOKENIZER_FILES):
    compact_chat.record_chat_format(out_dir, cfg.tokenizer.tool_preamble)
    return out_dir
  staging = out_dir.with_name(out_dir.name + ".tmp")
  shutil.rmtree(staging, ignore_errors=True)
  if cfg.tokenizer.source == "train":
    corpus = tokenizer_corpus(cfg.tokenizer.train.corpus_tasks, cfg.tokenizer.train.seed,
                              cfg.workflow.action_space)
    # The tiny base's echoes need separators no text holds; other runs' vocabularies stay as were.
    reserved = tokenizer_lib.PRETRAIN_TOKENS if cfg.model.source == "tiny_base" else ()
    tokenizer_lib.train_tokenizer(corpus, cfg.tokenizer.train.vocab_size, staging,
                                  chat_family=tokenizer_lib.FAMILY_OF_MODEL_TYPE[model_type(cfg)],
                                  reserved=reserved)
  else:
    source = Path(cfg.tokenizer.path or cfg.model.path)
    staging.mkdir(parents=True)
    for name in tokenizer_lib.TOKENIZER_FILES:
      if not (source / name).is_file():
        raise FileNotFoundError(f"tokenizer file {source / name} is missing (config "
                                "tokenizer.path / model.path)")
      shutil.copy2(source / name, staging / name)
  # Exports copy these files: the policy folder then says which chat format it was trained on.
  compact_chat.record_chat_format(staging, cfg.tokenizer.tool_preamble)
  staging.rename(out_dir)
  return out_dir


def chat_format(cfg: RunConfig, tokenizer_dir: Path) -> chat_format_lib.ChatFormat:
  return compact_chat.chat_format_for(cfg.tokenizer.tool_preamble, model_type(cfg),
                                      tokenizer_lib.load_tokenizer(tokenizer_dir))


# --- model -------------------------------------------------------------------------------------

def initial_model(cfg: RunConfig) -> nnx.Module:
  """The policy before SFT: random init (seeded) for `scratch`, else the local checkpoint."""
  dtype, param_dtype = model_dtypes(cfg)
  if cfg.model.source in FROM_HF_CONFIG:
    model_cfg = ModelConfig.from_hf_dict(cfg.model.hf_config.to_dict(), dtype=dtype,
                                         param_dtype=param_dtype)
    return build_model(model_cfg, rngs=nnx.Rngs(cfg.seed))
  return load_pretrained(cfg.model.path, dtype=dtype, param_dtype=param_dtype)


def load_policy(cfg: RunConfig, policy_dir: Path, mesh: jax.sharding.Mesh) -> nnx.Module:
  """An exported policy (HF safetensors) with the run's dtypes, each param read slice by slice
  straight onto its shards of `mesh` under `sharding.rules` (the SFT policy and every round's
  start live sharded: never a whole copy on one device)."""
  dtype, param_dtype = model_dtypes(cfg)
  return load_pretrained(policy_dir, dtype=dtype, param_dtype=param_dtype, mesh=mesh,
                         rules=tuple(cfg.sharding.rules))


def vision_source(cfg: RunConfig) -> Path | None:
  """The checkpoint whose vision tower a multimodal policy's exports carry (None for a text-only
  or from-scratch policy): SGLang 0.5.23 serves Qwen3.5 only as the multimodal
  `Qwen3_5ForConditionalGeneration`, which builds the tower and its processor."""
  if cfg.model.source in FROM_HF_CONFIG:
    return None
  path = Path(cfg.model.path)
  return path if ModelConfig.from_pretrained_dir(path).is_multimodal_layout else None


# --- cold-start SFT examples -------------------------------------------------------------------

ROWS_PER_CELL = 24  # SFT rows of one (track, outcome) task over its six foci (expert solvers)


def sft_states(num_examples: int) -> tuple[tuple[grid.GridState, ...], int]:
  """`(grid states, tasks per state)` whose expert actions give about `num_examples` rows.

  Whole (track, outcome) cells are taken in round-robin order (all six foci of a cell share one
  task instance), so a small set still spans every track before repeating one.
  """
  cells = [(t, o) for o in workflow.OUTCOMES for t in workflow.TRACKS]
  wanted = max(1, math.ceil(num_examples / ROWS_PER_CELL))
  if wanted >= len(cells):
    return grid.SOURCE_GRID, math.ceil(wanted / len(cells))
  keep = set(cells[:wanted])
  return tuple(s for s in grid.SOURCE_GRID if (s.track, s.outcome) in keep), 1


def prepare_sft_rows(cfg: RunConfig, out_dir: Path, markers_path: Path) -> Path:
  """The Stage Bank's leak-checked cold-start rows (expert trajectories), published once."""
  if (out_dir / shards.MANIFEST).is_file():
    return out_dir
  states, per_state = sft_states(cfg.sft.num_examples)
  spec = sft_rows.SftSpec(seed=cfg.stagebank.seed, tasks_per_state=per_state, states=states,
                          action_space=cfg.workflow.action_space,
                          first_action_tasks=cfg.sft.first_action_tasks,
                          e2e_tasks=cfg.sft.e2e_tasks, stop_rows=cfg.sft.stop_rows,
                          stage_stop_rows=cfg.sft.stage_stop_rows,
                          reaction_tasks=cfg.sft.reaction_tasks)
  checker = leakcheck.LeakChecker(load_matcher(markers_path))
  return sft_rows.build_sft_set(out_dir, spec, checker,
                                sandbox_limits=cfg.sandbox, workers=cfg.stagebank.workers)


def sft_examples(cfg: RunConfig, rows_dir: Path,
                 chat_format: chat_format_lib.ChatFormat) -> tuple[list[Example], list[Example]]:
  """`(train, validation)` `(ids, loss_mask)` examples rendered in the policy's chat format.

  Rows longer than `sft.max_seq_len` are dropped; the rest are shuffled (seeded), the
  validation share (`sft.validation_fraction`, at most `sft.max_validation_examples`) is split
  off and the train set is cut to `sft.num_examples` plus the rows of the `sft.first_action_tasks`,
  `sft.e2e_tasks` and `sft.reaction_tasks` parts. With `sft.decision_balance` > 0, train rows of
  rare decisions (`sft_rows.decision_kind`) are repeated (`bat_jax.sft.balanced_repeats`).
  """
  rows = sft_rows.load_sft_rows(rows_dir)
  extra_rows = sum(r["metadata"].get("sft_part", "full") != "full" for r in rows)
  encoded = [chat_format.encode_sft_example(r["messages"], sft_rows.target_action(r)) for r in rows]
  kept, dropped = drop_too_long(encoded, cfg.sft.max_seq_len)
  if dropped:
    log.info("SFT: dropped %d of %d rows longer than %d tokens", len(dropped), len(encoded),
             cfg.sft.max_seq_len)
  if not kept:
    raise ValueError(f"no SFT row fits sft.max_seq_len = {cfg.sft.max_seq_len}")
  gone = set(dropped)
  kinds = [sft_rows.decision_kind(r) for i, r in enumerate(rows) if i not in gone]
  order = list(range(len(kept)))
  random.Random(cfg.seed).shuffle(order)
  n_val = min(cfg.sft.max_validation_examples,
              math.ceil(cfg.sft.validation_fraction * len(kept)))
  n_val = min(n_val, len(kept) - 1)
  train = order[n_val:][:cfg.sft.num_examples + extra_rows]
  # Repeats after the split: a validation row never has a copy in the train set.
  repeats = balanced_repeats([kinds[i] for i in train], cfg.sft.decision_balance)
  return ([kept[i] for i, r in zip(train, repeats) for _ in range(r)],
          [kept[i] for i in order[:n_val]])


def example_lengths(examples: Sequence[Example]) -> list[int]:
  return [len(ids) for ids, _ in examples]
