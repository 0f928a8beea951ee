"""The tiny base model (`model.source = "tiny_base"`): pretrained here on the generated corpus.

The analogue of loading a pretrained checkpoint. `ensure_base` builds it once per config and
reuses it after: the folder is keyed by a hash of everything that decides its weights (the
`pretrain` section, the model's `hf_config`, the tokenizer's files and `GENERATOR_VERSION`), so
repeated runs and the study's seeds and modes share one base.

    cache_dir/<key>/model/        HF safetensors + config + tokenizer (what SFT starts from)
    cache_dir/<key>/base.json     probe copy accuracy, loss, steps, seconds (the report's record)
    cache_dir/<key>.build/        orbax checkpoints of an unfinished build (resumed, then removed)

Pretraining is the SFT trainer on packed plain-text documents with the next-token loss on
every token (`corpus.plain_text`), so it is seeded, resumable and bit-identical like SFT. The
corpus is leak-checked against this run's held-out markers on every use, built or reused: a
base must never have seen held-out content, and a hit fails closed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax.io_utils import atomic_write_json
from bat_jax.model import tokenizer as tokenizer_lib
from bat_jax.pretrain import corpus

log = logging.getLogger(__name__)

RECORD = "base.json"
PROBE_SEED_OFFSET = 1_000_003   # probes come from another seed's documents: never trained on


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
  """The `pretrain` config section (see configs/base.py)."""
  steps: int
  batch_size: int
  seq_len: int
  lr: float
  warmup_steps: int
  seed: int
  probes: int
  checkpoint_every: int
  cache_dir: str

  @classmethod
  def from_config(cls, section: Any) -> "PretrainConfig":
    return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls)})

  def key_fields(self) -> dict[str, Any]:
    """What decides the weights (the cache directory and checkpointing cadence do not)."""
    return {k: v for k, v in dataclasses.asdict(self).items()
            if k not in ("cache_dir", "checkpoint_every")}


def cache_key(pcfg: PretrainConfig, hf_config: dict[str, Any], tokenizer_dir: Path) -> str:
  """sha256 (24 hex) of the generator version, the pretrain fields, the model config and the
  tokenizer's files."""
  h = hashlib.sha256()
  h.update(json.dumps({"generator": corpus.GENERATOR_VERSION, "pretrain": pcfg.key_fields(),
                       "hf_config": hf_config}, sort_keys=True, default=str).encode())
  for name in sorted(tokenizer_lib.TOKENIZER_FILES):
    path = Path(tokenizer_dir) / name
    if name != "tokenizer_config.json":  # carries the chat-format record, not the vocabulary
      h.update(name.encode() + b"\0" + path.read_bytes())
  return h.hexdigest()[:24]


def _n_documents(tokens_needed: int) -> int:
  return max(1, tokens_needed // 64)  # generous: documents are ~120 tokens; trimmed below


def _encoded_documents(tokenizer: Any, seed: int, start: int, count: int, eot_id: int
                       ) -> list[tuple[list[int], list[int]]]:
  """`(ids, loss mask)` of documents `start..start+count`, each ending in `eot_id`."""
  pieces = [corpus.plain_segments(d) for d in corpus.documents(seed, start, count)]
  encoded = iter(tokenizer([t for doc in pieces for t, _ in doc],
                           add_special_tokens=False)["input_ids"])
  out = []
  for doc in pieces:
    ids: list[int] = []
    mask: list[int] = []
    for _, is_call in doc:
      piece = next(encoded)
      ids += piece
      mask += [int(is_call)] * len(piece)
    out.append((ids + [eot_id], mask + [0]))
  return out


ECHO_SHARE = 2   # every ECHO_SHARE-th packed document is an echo (`_echo`)


@functools.lru_cache(maxsize=4)
def _echo_pool(tokenizer: Any) -> np.ndarray:
  """Vocabulary pieces that decode to a word or number (with or without its leading space):
  markup, paths and control tokens stay out of random lists (a `/think` piece reads as a path
  to the leak check, which rightly refuses it)."""
  word = re.compile(r" ?[A-Za-z0-9_]+")
  special = set(tokenizer.all_special_ids)
  return np.array([i for i in range(len(tokenizer))
                   if i not in special and word.fullmatch(tokenizer.decode([i]))])


def _echo(tokenizer: Any, seed: int, index: int, eot_id: int) -> tuple[list[int], list[int]]:
  """Distinct random vocabulary pieces, then the same pieces again after `$ echo`: the densest
  copying signal there is (every repeated piece is predictable only by looking back), which
  grows induction heads in a few hundred steps where the documents alone did not (measured:
  experiments/README.md, "The tiny base")."""
  rng = np.random.default_rng([seed, index, 7])
  pool = _echo_pool(tokenizer)
  pieces = rng.choice(pool, size=int(rng.integers(12, 40)), replace=False).tolist()
  head = tokenizer("Copy:", add_special_tokens=False)["input_ids"]
  mid = tokenizer("\n$ echo", add_special_tokens=False)["input_ids"]
  end = tokenizer("\n", add_special_tokens=False)["input_ids"]
  ids = head + pieces + mid + pieces + end + [eot_id]
  return ids, [0] * (len(head) + len(pieces) + len(mid)) + [1] * (len(pieces) + len(end)) + [0]


def packed_rows(tokenizer: Any, pcfg: PretrainConfig, eot_id: int
                ) -> tuple[list[tuple[list[int], list[int]]], int]:
  """`(rows, documents used)`: `steps x batch_size` rows of `seq_len` tokens, each filled with
  whole documents (never one cut in two: a cut document's call would copy from nothing) and
  padded with `eot_id`; the loss is on the calls (`corpus.plain_segments`)."""
  rows: list[tuple[list[int], list[int]]] = []
  ids: list[int] = []
  mask: list[int] = []
  index = 0
  while len(rows) < pcfg.steps * pcfg.batch_size:
    docs = _encoded_documents(tokenizer, pcfg.seed, index, 256, eot_id)
    mixed = [d for i, doc in enumerate(docs)
             for d in ([doc, _echo(tokenizer, pcfg.seed, index + i, eot_id)]
                       if (index + i) % ECHO_SHARE == 0 else [doc])]
    index += len(docs)
    for doc_ids, doc_mask in mixed:
      if len(doc_ids) > pcfg.seq_len:
        continue  # longer than a row: skipped (deterministically)
      if len(ids) + len(doc_ids) > pcfg.seq_len:
        pad = pcfg.seq_len - len(ids)
        rows.append((ids + [eot_id] * pad, [0] + mask[1:] + [0] * pad))
        ids, mask = [], []
        if len(rows) == pcfg.steps * pcfg.batch_size:
          break
      ids, mask = ids + doc_ids, mask + doc_mask
  return rows, index


def check_corpus(checker: Any, tokenizer: Any, pcfg: PretrainConfig, n_documents: int,
                 eot_id: int) -> int:
  """Leak-checks the first `n_documents` documents and their echoes (what pretraining used);
  raises on a hit."""
  for start in range(0, n_documents, 512):
    for i, doc in enumerate(corpus.documents(pcfg.seed, start, min(512, n_documents - start))):
      index = start + i
      texts = ["".join(corpus.plain_text(doc))]
      if index % ECHO_SHARE == 0:
        texts.append(tokenizer.decode(_echo(tokenizer, pcfg.seed, index, eot_id)[0][:-1]))
      for text in texts:
        findings = checker.check_row({"text": text}, index=index, pool="pretrain")
        if findings:
          raise ValueError(f"pretraining document {index} (seed {pcfg.seed}) fails the leak "
                           f"check: {findings[0]}; the base must never see held-out content")
  return n_documents


def greedy_calls(model: nnx.Module, tokenizer: Any, contexts: Sequence[str], *, eot_id: int,
                 max_new: int = 48) -> list[str]:
  """Each context's greedy continuation up to its first newline (batched, full recompute: the
  probe is small and this keeps it independent of the rollout engine)."""
  ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in contexts]
  width = max(map(len, ids)) + max_new
  tokens = np.full((len(ids), width), eot_id, np.int32)                 # [P, W]
  for i, row in enumerate(ids):
    tokens[i, :len(row)] = row
  lengths = np.array([len(r) for r in ids])
  start = lengths.copy()

  @jax.jit
  def next_tokens(tokens, lengths):
    valid = jnp.arange(width)[None, :] < lengths[:, None]
    logits = model(tokens, valid=valid)                                 # [P, W, V]
    return jnp.argmax(logits[jnp.arange(tokens.shape[0]), lengths - 1], axis=-1)

  done = np.zeros(len(ids), bool)
  for _ in range(max_new):
    nxt = np.asarray(next_tokens(jnp.asarray(tokens), jnp.asarray(lengths)))
    for i in np.flatnonzero(~done):
      tokens[i, lengths[i]] = nxt[i]
      lengths[i] += 1
      done[i] = "\n" in tokenizer.decode(tokens[i, start[i]:lengths[i]].tolist())
    if done.all():
      break
  return [tokenizer.decode(tokens[i, start[i]:lengths[i]].tolist()).split("\n")[0]
          for i in range(len(ids))]


def probe_copy(model: nnx.Module, tokenizer: Any, pcfg: PretrainConfig,
               eot_id: int) -> dict[str, Any]:
  """Copy accuracy on fresh documents (another seed's): the share of target calls decoded
  exactly, and of the copied values that appear in the decoded call, per kind."""
  docs = corpus.documents(pcfg.seed + PROBE_SEED_OFFSET, 0, pcfg.probes)
  texts = [corpus.plain_text(d) for d in docs]
  calls = greedy_calls(model, tokenizer, [c for c, _ in texts], eot_id=eot_id)
  per_kind: dict[str, list[int]] = {}
  values = hits = 0
  for doc, (_, target), call in zip(docs, texts, calls):
    per_kind.setdefault(doc.kind, []).append(int(call.strip() == target.strip()))
    values += len(doc.answer)
    hits += sum(v in call for v in doc.answer)
  exact = [x for xs in per_kind.values() for x in xs]
  return {"probes": len(docs), "copy_accuracy": float(np.mean(exact)),
          "value_accuracy": hits / max(values, 1),
          "by_kind": {k: float(np.mean(v)) for k, v in sorted(per_kind.items())},
          "example": {"expected": texts[0][1].strip(), "decoded": calls[0].strip()}}


def cache_root(pcfg: PretrainConfig) -> Path:
  return Path(pcfg.cache_dir).expanduser()


def load_record(base_dir: Path) -> Optional[dict[str, Any]]:
  path = base_dir / RECORD
  return json.loads(path.read_text()) if (base_dir / "model").is_dir() and path.is_file() else None


def ensure_base(build: Any, pcfg: PretrainConfig, hf_config: dict[str, Any], tokenizer_dir: Path,
                checker: Any, *, mesh: jax.sharding.Mesh, rules: Any) -> tuple[Path, dict]:
  """The base's HF folder and its record, built (resumably) unless the cache holds it.

  `build` is `() -> model` (the seeded from-scratch init); `checker` the run's `LeakChecker`.
  """
  from bat_jax.checkpointing import export_hf      # heavy imports: only when building
  from bat_jax.sft import SftConfig, run_sft
  from bat_jax.train.step import OptimizerConfig
  key = cache_key(pcfg, hf_config, tokenizer_dir)
  base_dir = cache_root(pcfg) / key
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
  eot_id = tokenizer.convert_tokens_to_ids(tokenizer_lib.ENDOFTEXT)
  record = load_record(base_dir)
  if record is not None:
    check_corpus(checker, tokenizer, pcfg, record["documents"], eot_id)
    return base_dir / "model", {**record, "cache_hit": True}
  start = time.monotonic()
  rows, n_docs = packed_rows(tokenizer, pcfg, eot_id)
  check_corpus(checker, tokenizer, pcfg, n_docs, eot_id)
  sft_cfg = SftConfig(num_steps=pcfg.steps, batch_size=pcfg.batch_size, max_len=pcfg.seq_len,
                      seed=pcfg.seed, checkpoint_every=pcfg.checkpoint_every, pad_id=eot_id,
                      optimizer=OptimizerConfig(learning_rate=pcfg.lr, schedule="cosine",
                                                warmup_steps=pcfg.warmup_steps,
                                                total_steps=pcfg.steps))
  model = nnx.eval_shape(build)
  losses: list[float] = []

  def on_step(step: int, metrics: dict[str, Any]) -> None:
    loss = float(metrics["loss"])
    if not np.isfinite(loss):
      raise FloatingPointError(f"pretraining step {step}: non-finite loss {loss}")
    losses.append(loss)

  staging = base_dir.with_name(key + ".build")
  run_sft(model, rows, sft_cfg, staging / "ckpt", mesh=mesh, rules=rules,
          make_params=lambda trainer: trainer.init_params(build), on_step=on_step)
  train_s = time.monotonic() - start
  probe = probe_copy(model, tokenizer, pcfg, eot_id)
  export_hf(model, staging / "model", tokenizer_dir=tokenizer_dir)
  record = {"key": key, "generator": corpus.GENERATOR_VERSION, "steps": pcfg.steps,
            "documents": n_docs, "tokens": pcfg.steps * pcfg.batch_size * pcfg.seq_len,
            "final_loss": losses[-1] if losses else None, "train_seconds": round(train_s, 1),
            "seconds": round(time.monotonic() - start, 1), **probe}
  atomic_write_json(staging / RECORD, record)
  shutil.rmtree(staging / "ckpt", ignore_errors=True)
  if base_dir.exists():  # a concurrent build finished first: keep it, drop ours
    shutil.rmtree(staging, ignore_errors=True)
  else:
    staging.rename(base_dir)
  log.info("tiny base %s: copy accuracy %.3f on %d probes, %.0f s", key,
           record["copy_accuracy"], record["probes"], record["seconds"])
  return base_dir / "model", {**record, "cache_hit": False}
