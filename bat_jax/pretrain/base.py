"""The tiny base model (`model.source = "tiny_base"`): pretrained here on the generated corpus.

The analogue of loading a pretrained checkpoint. `ensure_base` builds it once per config and
reuses it after: the folder is keyed by a hash of everything that decides its weights (the
`pretrain` section, the model's `hf_config`, the tokenizer's files and `GENERATOR_VERSION`), so
repeated runs and the study's seeds and modes share one base.

    cache_dir/<key>/model/        HF safetensors + config + tokenizer (what SFT starts from)
    cache_dir/<key>/base.json     probe copy accuracy, loss, steps, seconds (the report's record)
    cache_dir/<key>.build/        orbax checkpoints of an unfinished build (resumed, then removed)
    cache_dir/<key>.lock          held while the entry is looked up or built (one builder a key)

Pretraining is the SFT trainer in four phases, so it is seeded, resumable and bit-identical
like SFT: `echo_steps` of short echoes in short rows, then `echo_long_steps` of longer ones
(random vocabulary pieces between the tokenizer's reserved separators, then the same pieces
again: where induction heads form), then `steps` of packed plain-text documents
(`corpus.plain_text`) with an echo after every second one, the loss on the calls and on the
echoes' second copies, then `extend_steps` of the next documents packed into rows as long as a
task's episode (context extension: a base trained on 256-token rows copied none of its probes
after 500 tokens of other documents; `probe.probe_copy`'s deep probe). The
corpus is leak-checked against this run's held-out markers on every use, built or reused: a
base must never have seen held-out content, and a hit fails closed (an echo the check refuses
is drawn again, and the redraw recorded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import itertools
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import jax
import numpy as np
from flax import nnx

from bat_jax.io_utils import atomic_write_json
from bat_jax.model import tokenizer as tokenizer_lib
from bat_jax.pretrain import corpus
from bat_jax.pretrain import probe as probe_lib
from bat_jax.pretrain.host import host_record

log = logging.getLogger(__name__)

RECORD = "base.json"


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
  """The `pretrain` config section (see configs/base.py)."""
  echo_steps: int
  echo_batch_size: int
  echo_seq_len: int
  echo_long_steps: int
  echo_long_batch_size: int
  echo_long_seq_len: int
  steps: int
  batch_size: int
  seq_len: int
  lr: float
  extend_steps: int              # then the next documents in rows of `extend_seq_len` tokens
  extend_batch_size: int
  extend_seq_len: int
  extend_lr: float
  warmup_steps: int
  seed: int
  probes: int
  probe_depth: int
  checkpoint_every: int
  cache_dir: str

  @classmethod
  def from_config(cls, section: Any) -> "PretrainConfig":
    return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls)})

  def key_fields(self) -> dict[str, Any]:
    """What decides the weights (the cache directory and checkpointing cadence do not)."""
    return {k: v for k, v in dataclasses.asdict(self).items()
            if k not in ("cache_dir", "checkpoint_every")}


def cache_key(pcfg: PretrainConfig, hf_config: dict[str, Any], tokenizer_dir: Path,
              heldout_key: str = "") -> str:
  """sha256 (24 hex) of the generator version, the pretrain fields, the model config, the
  tokenizer's files and `heldout_key` (which held-out cells the corpus was leak-checked
  against: a document the check refuses is drawn again, so another held-out set can give
  another corpus)."""
  h = hashlib.sha256()
  h.update(json.dumps({"generator": corpus.GENERATOR_VERSION, "pretrain": pcfg.key_fields(),
                       "hf_config": hf_config, "heldout": heldout_key},
                      sort_keys=True, default=str).encode())
  for name in sorted(tokenizer_lib.TOKENIZER_FILES):
    path = Path(tokenizer_dir) / name
    if name != "tokenizer_config.json":  # carries the chat-format record, not the vocabulary
      h.update(name.encode() + b"\0" + path.read_bytes())
  return h.hexdigest()[:24]


ECHO_SHARE = 2   # every ECHO_SHARE-th packed document is an echo (`_echo`)
# Echo indices of the echo-only phases (never a document's): short, then long lists.
ECHO_PHASE_START = {"echo": 10_000_000, "echo_long": 20_000_000}
# Lists an echo copies, by phase: a short -> long curriculum. Lists of 2-6 in 32-token rows end
# the copying plateau by step ~80, 4-13 in 64-token rows by ~150, 12-40 in 256-token rows at
# 250-350 or never (at init attention is spread over the whole row, so the look-back signal is
# ~1/row length; experiments/README.md, "The tiny base"). Heads grown on short lists do not
# carry to long ones at once, so each phase lengthens them.
ECHO_LENGTHS = {"echo": (2, 7), "echo_long": (4, 14), "corpus": (4, 24)}
MAX_REDRAWS = 8   # an echo the leak check refuses is drawn again, at most this many times


# An echo is `<|echo_list|>` pieces `<|echo_copy|>` the same pieces `<|endoftext|>`: separators
# reserved in the tokenizer (`tokenizer.PRETRAIN_TOKENS`), which no list and no text holds. With
# text separators (`:` `$` `\n`, or `Copy: ... $ echo ...`) the plateau was still flat at step
# 300 where reserved ones crossed it (experiments/README.md, "The tiny base").
# Any change to how echoes or rows are drawn must bump `corpus.GENERATOR_VERSION` (the cache key).


def _phase_of(index: int) -> str:
  """The phase whose lengths echo `index` draws (`ECHO_LENGTHS`)."""
  for name in ("echo_long", "echo"):
    if index >= ECHO_PHASE_START[name]:
      return name
  return "corpus"


@functools.lru_cache(maxsize=4)   # per echo otherwise: `get_vocab` was 20% of the corpus draw
def _separators(tokenizer: Any) -> tuple[int, int]:
  vocab = tokenizer.get_vocab()
  missing = [t for t in tokenizer_lib.PRETRAIN_TOKENS if t not in vocab]
  if missing:
    raise ValueError(f"the tokenizer lacks the tiny base's reserved echo separators {missing}; "
                     "train it with reserved=tokenizer.PRETRAIN_TOKENS (setup does for "
                     "model.source = 'tiny_base')")
  return tuple(vocab[t] for t in tokenizer_lib.PRETRAIN_TOKENS)


@functools.lru_cache(maxsize=4)
def _echo_pool(tokenizer: Any) -> np.ndarray:
  """Every vocabulary piece but the special tokens and the separators. A smaller pool (the
  word pieces alone, 710 of 1,024) kept the copying plateau flat for 300 steps where the whole
  vocabulary crossed it at ~250 (experiments/README.md); pieces that make an echo read as a
  path or a held-out marker are refused by the leak check, and that echo is drawn again
  (`_first_clean`)."""
  excluded = set(tokenizer.all_special_ids).union(_separators(tokenizer))
  return np.array([i for i in range(len(tokenizer)) if i not in excluded])


def _echo(tokenizer: Any, seed: int, index: int, eot_id: int, attempt: int = 0
          ) -> tuple[list[int], list[int]]:
  """Distinct random vocabulary pieces, then the same pieces again: the densest copying signal
  there is (every repeated piece is predictable only by looking back), the one on which
  induction heads form (experiments/README.md, "The tiny base")."""
  rng = np.random.default_rng([seed, index, 7, attempt])
  size = int(rng.integers(*ECHO_LENGTHS[_phase_of(index)]))
  pieces = rng.choice(_echo_pool(tokenizer), size=size, replace=False).tolist()
  return echo_document(pieces, *_separators(tokenizer), eot_id)


def echo_document(pieces: list[int], head: int, mid: int, eot_id: int
                  ) -> tuple[list[int], list[int]]:
  """`(ids, loss mask)` of one echo: `head` pieces `mid` the same pieces `eot_id`, the loss on
  the second copy only."""
  ids = [head] + pieces + [mid] + pieces + [eot_id]
  return ids, [0] * (len(pieces) + 2) + [1] * len(pieces) + [0]


def _echo_text(tokenizer: Any, seed: int, index: int, eot_id: int, attempt: int) -> str:
  return tokenizer.decode(_echo(tokenizer, seed, index, eot_id, attempt)[0][:-1])


def _document_text(seed: int, index: int, attempt: int) -> str:
  return "".join(corpus.plain_text(corpus.document(seed, index, attempt=attempt)))


def _first_clean(text: Callable[[int], str], index: int, checker: Any,
                 redraws: dict[int, int]) -> Optional[int]:
  """The first attempt whose `text(attempt)` the leak check accepts (None: none of
  `MAX_REDRAWS`). Random pieces spell what the check refuses: ~1,680 of the default base's
  ~38,500 echoes look like host paths (`/plan`, `</think>`: the same for every run), and a few
  texts spell the building run's held-out markers (document 8939 for most runs' cells; one more
  echo for some), so the base a fresh cache builds can depend on the building run's cells. A
  redraw goes into `redraws` (-1: skipped), so a reused base re-checks exactly the text it was
  trained on."""
  for attempt in range(MAX_REDRAWS):
    if not checker.check_row({"text": text(attempt)}, index=index, pool="pretrain"):
      if attempt:
        redraws[index] = attempt
      return attempt
  redraws[index] = -1
  return None


def _pack(docs: Iterator[tuple[list[int], list[int]]], n_rows: int, seq_len: int, eot_id: int
          ) -> list[tuple[list[int], list[int]]]:
  """`n_rows` rows of `seq_len` tokens, each filled with whole documents (never one cut in
  two: a cut document's call would copy from nothing) and padded with `eot_id`."""
  rows: list[tuple[list[int], list[int]]] = []
  ids: list[int] = []
  mask: list[int] = []
  for doc_ids, doc_mask in docs:
    if len(doc_ids) > seq_len:
      continue  # longer than a row: skipped (deterministically)
    if len(ids) + len(doc_ids) > seq_len:
      pad = seq_len - len(ids)
      rows.append((ids + [eot_id] * pad, [0] + mask[1:] + [0] * pad))
      ids, mask = [], []
      if len(rows) == n_rows:
        break
    ids, mask = ids + doc_ids, mask + doc_mask
  return rows


@dataclasses.dataclass
class Corpus:
  """What pretraining trains on: the echo-only phases' rows, then the corpus rows."""
  echo_rows: list[tuple[list[int], list[int]]]
  echo_long_rows: list[tuple[list[int], list[int]]]
  rows: list[tuple[list[int], list[int]]]
  extend_rows: list[tuple[list[int], list[int]]]
  documents: int                 # corpus documents drawn (indices 0..documents-1)
  echoes: int                    # echo-phase echoes drawn (from ECHO_PHASE_START["echo"])
  long_echoes: int               # long-echo-phase echoes drawn (from ECHO_PHASE_START["echo_long"])
  document_redraws: dict[int, int]   # document index -> the attempt trained on (-1: skipped)
  echo_redraws: dict[int, int]       # echo index -> the attempt trained on (-1: skipped)

  def record(self) -> dict[str, Any]:
    """What a reused base's leak check needs (`check_corpus`)."""
    return {"documents": self.documents, "echoes": self.echoes, "long_echoes": self.long_echoes,
            **{f"{k}_redraws": {str(i): a for i, a in sorted(r.items())}
               for k, r in (("document", self.document_redraws), ("echo", self.echo_redraws))}}


def build_corpus(tokenizer: Any, pcfg: PretrainConfig, eot_id: int, checker: Any) -> Corpus:
  """Every phase's packed rows (loss on the calls and on the echoes' second copies); every
  document and echo is one the leak check accepts (`_first_clean`), checked as it is drawn."""
  doc_redraws: dict[int, int] = {}
  echo_redraws: dict[int, int] = {}
  counts = {"documents": 0, "echo": 0, "echo_long": 0}

  def echo(index: int):
    attempt = _first_clean(lambda a: _echo_text(tokenizer, pcfg.seed, index, eot_id, a), index,
                           checker, echo_redraws)
    return None if attempt is None else _echo(tokenizer, pcfg.seed, index, eot_id, attempt)

  def echoes(phase: str):
    for index in itertools.count(ECHO_PHASE_START[phase]):
      counts[phase] += 1
      if (drawn := echo(index)) is not None:
        yield drawn

  def documents():
    for start in itertools.count(0, 256):
      chosen = [(i, _first_clean(lambda a: _document_text(pcfg.seed, i, a), i, checker,
                                 doc_redraws)) for i in range(start, start + 256)]
      kept = [(i, corpus.document(pcfg.seed, i, attempt=a)) for i, a in chosen if a is not None]
      for (i, _), encoded in zip(kept, corpus.encoded_documents(tokenizer, [d for _, d in kept],
                                                          eot_id)):
        counts["documents"] = i + 1
        # Drawn (and leak-checked) before the document is handed out: a phase's rows can end
        # right after document i, and a reuse re-checks echo i of every document counted.
        drawn = echo(i) if i % ECHO_SHARE == 0 else None
        yield encoded
        if drawn is not None:
          yield drawn

  echo_rows = {}
  for phase in ("echo", "echo_long"):
    steps, batch, seq = phase_shape(pcfg, f"{phase}_")
    longest = 3 + 2 * (ECHO_LENGTHS[phase][1] - 1)   # two separators, <eot>, the list twice
    if steps and seq < longest:  # `_pack` would skip every echo, forever
      raise ValueError(f"pretrain.{phase}_seq_len={seq} is shorter than the longest "
                       f"{phase} echo ({longest} tokens); set it to at least {longest}")
    echo_rows[phase] = _pack(echoes(phase), steps * batch, seq, eot_id) if steps else []
  docs = documents()   # the extension phase's rows go on where the corpus phase's end
  rows = _pack(docs, pcfg.steps * pcfg.batch_size, pcfg.seq_len, eot_id)
  extend_rows = (_pack(docs, pcfg.extend_steps * pcfg.extend_batch_size, pcfg.extend_seq_len,
                       eot_id) if pcfg.extend_steps else [])
  return Corpus(echo_rows["echo"], echo_rows["echo_long"], rows, extend_rows,
                counts["documents"], counts["echo"], counts["echo_long"], doc_redraws,
                echo_redraws)


class CorpusLeakError(ValueError):
  """A base's corpus holds a string of this run's held-out markers (`check_corpus`)."""


def check_corpus(checker: Any, tokenizer: Any, pcfg: PretrainConfig, record: Mapping[str, Any],
                 eot_id: int) -> None:
  """Leak-checks what a base with `record` was trained on: its documents and echoes as drawn
  (`record["document_redraws"]`, `record["echo_redraws"]`); raises on a hit. A reused base
  runs it with this run's checker; a build checks each text as it draws it (`build_corpus`)."""
  redraws = {k: {int(i): a for i, a in record.get(f"{k}_redraws", {}).items()}
             for k in ("document", "echo")}

  def refuse(what: str, index: int, text: Callable[[int], str]) -> None:
    attempt = redraws[what].get(index, 0)
    if attempt < 0:
      return  # skipped: never trained on
    findings = checker.check_row({"text": text(attempt)}, index=index, pool="pretrain")
    if findings:
      raise CorpusLeakError(f"pretraining {what} {index} (seed {pcfg.seed}) fails the leak "
                            f"check: {findings[0]}; the base must never see held-out content")

  echo = lambda a, i: _echo_text(tokenizer, pcfg.seed, i, eot_id, a)
  for index in range(record["documents"]):
    refuse("document", index, lambda a: _document_text(pcfg.seed, index, a))
    if index % ECHO_SHARE == 0 and redraws["document"].get(index, 0) >= 0:
      refuse("echo", index, lambda a: echo(a, index))
  for phase, count in (("echo", "echoes"), ("echo_long", "long_echoes")):
    start = ECHO_PHASE_START[phase]
    for index in range(start, start + record.get(count, 0)):
      refuse("echo", index, lambda a: echo(a, index))


def cache_root(pcfg: PretrainConfig) -> Path:
  return Path(pcfg.cache_dir).expanduser()


def load_record(base_dir: Path) -> Optional[dict[str, Any]]:
  path = base_dir / RECORD
  return json.loads(path.read_text()) if (base_dir / "model").is_dir() and path.is_file() else None


# (name, field prefix, learning-rate field, schedule), in training order: a phase's fields are
# `<prefix>steps`, `<prefix>batch_size`, `<prefix>seq_len` and its rows `Corpus.<prefix>rows`.
PHASES = (("echo", "echo_", "lr", "constant"), ("echo_long", "echo_long_", "lr", "constant"),
          ("corpus", "", "lr", "cosine"), ("extend", "extend_", "extend_lr", "cosine"))


def phase_shape(pcfg: PretrainConfig, prefix: str) -> tuple[int, int, int]:
  """`(steps, batch_size, seq_len)` of the phase whose fields start with `prefix`."""
  return tuple(getattr(pcfg, f"{prefix}{f}") for f in ("steps", "batch_size", "seq_len"))


def _train(model: nnx.Module, build: Any, pcfg: PretrainConfig, data: Corpus, staging: Path,
           eot_id: int, *, mesh: jax.sharding.Mesh, rules: Any) -> dict[str, Optional[float]]:
  """The four phases, each the SFT trainer with its own orbax folder (a finished phase restores
  and returns at once on a resume). The echo phases hold their learning rate after warmup: the
  copying plateau ends only while the rate is still high (measured:
  experiments/copy_reference.py); the corpus phase then decays it (cosine), and the extension
  warms up again to its own, lower rate and decays it."""
  from bat_jax.sft import SftConfig, run_sft      # heavy imports: only when building
  from bat_jax.train.step import OptimizerConfig
  losses: dict[str, dict[int, float]] = {name: {} for name, *_ in PHASES}
  seconds: dict[str, float] = {}

  def phase(name: str, rows, steps: int, shape: tuple[int, int], schedule: str, lr: float,
            make_params) -> None:
    cfg = SftConfig(num_steps=steps, batch_size=shape[0], max_len=shape[1],
                    seed=pcfg.seed, checkpoint_every=pcfg.checkpoint_every, pad_id=eot_id,
                    optimizer=OptimizerConfig(learning_rate=lr, schedule=schedule,
                                              warmup_steps=pcfg.warmup_steps,
                                              total_steps=steps))

    def on_step(step: int, metrics: dict[str, Any]) -> None:
      loss = float(metrics["loss"])
      if not np.isfinite(loss):
        raise FloatingPointError(f"pretraining {name} step {step}: non-finite loss {loss}")
      losses[name][int(step)] = loss

    start = time.monotonic()
    run_sft(model, rows, cfg, staging / f"ckpt_{name}", mesh=mesh, rules=rules,
            make_params=make_params, on_step=on_step)
    seconds[f"{name}_seconds"] = round(time.monotonic() - start, 1)

  make_params = lambda trainer: trainer.init_params(build)   # the first phase run inits
  for name, prefix, lr_field, schedule in PHASES:
    steps, batch_size, seq_len = phase_shape(pcfg, prefix)
    if steps:
      phase(name, getattr(data, f"{prefix}rows"), steps, (batch_size, seq_len), schedule,
            getattr(pcfg, lr_field), make_params)
      make_params = None
  return {**{f"{k}_final_loss": list(v.values())[-1] if v else None for k, v in losses.items()},
          **{f"{k}_loss_curve": loss_curve(v) for k, v in losses.items() if v}, **seconds}


LOSS_CURVE_BLOCK = 25   # steps per point of a phase's recorded loss curve


def loss_curve(losses: Mapping[int, float], block: int = LOSS_CURVE_BLOCK
               ) -> list[list[float]]:
  """`[first step, mean loss]` per `block` steps of `losses` (step -> loss): one draw's base
  copies and another's does not (experiments/README.md), and a final step's loss alone cannot
  say where a phase stalled. A resumed build holds only the steps run since its restore."""
  blocks: dict[int, list[float]] = {}
  for step, loss in sorted(losses.items()):
    blocks.setdefault((step - 1) // block * block + 1, []).append(loss)   # steps count from 1
  return [[first, round(float(np.mean(v)), 4)] for first, v in blocks.items()]


def ensure_base(build: Any, pcfg: PretrainConfig, hf_config: dict[str, Any], tokenizer_dir: Path,
                checker: Any, *, mesh: jax.sharding.Mesh, rules: Any,
                heldout_key: str = "") -> tuple[Path, dict]:
  """The base's HF folder and its record, built (resumably) unless the cache holds it.

  `build` is `() -> model` (the seeded from-scratch init); `checker` the run's `LeakChecker`,
  built from the held-out cells that `heldout_key` names. A cached base is re-checked against
  them; if its corpus holds one of their markers (held-out cells are drawn per run), this run
  gets a base of its own, built with that document drawn again and cached under a key that
  also names the cells (`cache_key`): never the refused base, never a crash.
  """
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
  eot_id = tokenizer.convert_tokens_to_ids(tokenizer_lib.ENDOFTEXT)
  for cells in ("", heldout_key):
    key = cache_key(pcfg, hf_config, tokenizer_dir, cells)
    base_dir = cache_root(pcfg) / key
    with _one_builder(base_dir):
      record = load_record(base_dir)
      if record is None:
        return _build_base(build, pcfg, tokenizer_dir, tokenizer, eot_id, checker, key,
                           base_dir, mesh=mesh, rules=rules)
      try:
        check_corpus(checker, tokenizer, pcfg, record, eot_id)
        return base_dir / "model", {**record, "cache_hit": True}
      except CorpusLeakError as e:
        if cells == heldout_key:
          raise
        log.warning("cached tiny base %s is refused for this run (%s); building one for this "
                    "run's held-out cells", key, e)
  raise AssertionError("unreachable: the run's own key either hits, builds or raises")


@contextlib.contextmanager
def _one_builder(base_dir: Path) -> Iterator[None]:
  """Holds `<key>.lock` (an exclusive flock) while the cache entry is looked up or built.

  Concurrent runs on one cache (the suite's workers, a study's seeds) wait for the first
  builder and then read its base: they never share the `<key>.build` staging folder, whose
  checkpoints the other would otherwise resume mid-build and then delete."""
  base_dir.parent.mkdir(parents=True, exist_ok=True)
  with open(base_dir.with_name(base_dir.name + ".lock"), "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _build_base(build: Any, pcfg: PretrainConfig, tokenizer_dir: Path, tokenizer: Any,
                eot_id: int, checker: Any, key: str, base_dir: Path, *,
                mesh: jax.sharding.Mesh, rules: Any) -> tuple[Path, dict]:
  """Builds, probes, exports and caches the base under `base_dir` (see `ensure_base`)."""
  from bat_jax.checkpointing import export_hf      # heavy imports: only when building
  start = time.monotonic()
  data = build_corpus(tokenizer, pcfg, eot_id, checker)   # leak-checked as drawn
  drawn = data.record()
  model = nnx.eval_shape(build)
  staging = base_dir.with_name(key + ".build")
  losses = _train(model, build, pcfg, data, staging, eot_id, mesh=mesh, rules=rules)
  train_s = time.monotonic() - start
  probe = probe_lib.probe_copy(model, tokenizer, pcfg, eot_id)
  export_hf(model, staging / "model", tokenizer_dir=tokenizer_dir)
  record = {"key": key, "generator": corpus.GENERATOR_VERSION, "echo_steps": pcfg.echo_steps,
            "echo_long_steps": pcfg.echo_long_steps, "steps": pcfg.steps,
            "extend_steps": pcfg.extend_steps, "extend_seq_len": pcfg.extend_seq_len, **drawn,
            "tokens": sum(int(np.prod(phase_shape(pcfg, prefix))) for _, prefix, *_ in PHASES),
            "final_loss": losses["corpus_final_loss"], **losses,
            "train_seconds": round(train_s, 1),
            "seconds": round(time.monotonic() - start, 1), **probe, "host": host_record()}
  atomic_write_json(staging / RECORD, record)
  for name, *_ in PHASES:
    shutil.rmtree(staging / f"ckpt_{name}", ignore_errors=True)
  # `_one_builder` holds the key's lock, so a folder here is a stale one with no record.
  shutil.rmtree(base_dir, ignore_errors=True)
  staging.rename(base_dir)
  log.info("tiny base %s: copy accuracy %.3f on %d probes, %.0f s", key,
           record["copy_accuracy"], record["probes"], record["seconds"])
  return base_dir / "model", {**record, "cache_hit": False}
