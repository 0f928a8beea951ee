"""The tiny base's copy probe: greedy (teacher-forced) copying on fresh corpus documents, alone
and after `probe_depth` tokens of other documents (where a task's episode makes its calls)."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax.pretrain import corpus

PROBE_SEED_OFFSET = 1_000_003   # probes come from another seed's documents: never trained on


def next_token_argmax(model: nnx.Module, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """`[P, W]`: the model's most likely next token at every position of `tokens` `[P, W]` (each
  row valid up to its length), from one batched forward pass."""
  valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
  forward = jax.jit(lambda t, v: jnp.argmax(model(t, valid=v), axis=-1))
  return np.asarray(forward(jnp.asarray(tokens), jnp.asarray(valid)))


def _probe_rows(tokenizer: Any, docs: Sequence[corpus.Document], eot_id: int, depth: int,
                filler_seed: int) -> tuple[list[list[int]], list[list[int]]]:
  """`(contexts, targets)` token lists of `docs`; with `depth` > 0 each context starts after at
  least `depth` tokens of other documents (whole ones, each ending in `eot_id`, as packed rows
  are), so the call is copied at the positions a task's long episode reaches."""
  encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
  fillers = (ids for start in itertools.count(0, 64)    # drawn as needed, 64 at a time
             for ids, _ in corpus.encoded_documents(
                 tokenizer, corpus.documents(filler_seed, start, 64), eot_id))
  contexts, targets = [], []
  for doc in docs:
    context, target = corpus.plain_text(doc)
    prefix: list[int] = []
    while len(prefix) < depth:
      prefix += next(fillers)
    contexts.append(prefix + encode(context))
    targets.append(encode(target))
  return contexts, targets


def _score_probe(model: nnx.Module, tokenizer: Any, docs: Sequence[corpus.Document],
                 contexts: Sequence[list[int]], targets: Sequence[list[int]], eot_id: int
                 ) -> tuple[dict[str, list[int]], float, list[str]]:
  """Per kind, 1 where greedy decoding writes the target call exactly; the share of copied
  values found in the predicted calls; the predicted calls."""
  lengths = np.array([len(c) + len(t) for c, t in zip(contexts, targets)])
  tokens = np.full((len(docs), int(lengths.max())), eot_id, np.int32)    # [P, W]
  for i, (context, target) in enumerate(zip(contexts, targets)):
    tokens[i, :lengths[i]] = context + target
  argmax = next_token_argmax(model, tokens, lengths)                      # [P, W]
  per_kind: dict[str, list[int]] = {}
  values = hits = 0
  predicted = []
  for i, (doc, context, target) in enumerate(zip(docs, contexts, targets)):
    guess = argmax[i, len(context) - 1:lengths[i] - 1].tolist()          # predicts target
    predicted.append(tokenizer.decode(guess))
    per_kind.setdefault(doc.kind, []).append(int(guess == target))
    values += len(doc.answer)
    hits += sum(v in predicted[-1] for v in doc.answer)
  return per_kind, hits / max(values, 1), predicted


def probe_copy(model: nnx.Module, tokenizer: Any, pcfg: Any,
               eot_id: int) -> dict[str, Any]:
  """Copy accuracy on fresh documents (another seed's), teacher-forced: a target call counts as
  copied when, given the context and the call's earlier tokens, the most likely next token is the
  call's own at every position, which is exactly when greedy decoding writes the call (in the
  target's tokenization). One forward pass instead of a decode loop (~35 s of the build, and a
  fixed token budget that cut long lists short). `value_accuracy`: the share of copied values
  found in the predicted call. `deep_*`: the same documents after `pcfg.probe_depth` tokens of
  other documents: a base trained on 256-token rows copied 0.83 of them alone and none after
  500 tokens, where a task's episode makes most of its calls (experiments/README.md). `pcfg`:
  the `pretrain` section (`base.PretrainConfig`, untyped here because base imports this
  module): its `seed`, `probes` and `probe_depth`."""
  docs = corpus.documents(pcfg.seed + PROBE_SEED_OFFSET, 0, pcfg.probes)
  out: dict[str, Any] = {"probes": len(docs), "probe_depth": pcfg.probe_depth}
  for prefix, depth in (("", 0), ("deep_", pcfg.probe_depth)):
    if prefix and not depth:
      continue
    contexts, targets = _probe_rows(tokenizer, docs, eot_id, depth,
                                    pcfg.seed + PROBE_SEED_OFFSET + 1)
    per_kind, value_accuracy, predicted = _score_probe(model, tokenizer, docs, contexts,
                                                       targets, eot_id)
    out.update({f"{prefix}copy_accuracy": float(np.mean([x for xs in per_kind.values()
                                                         for x in xs])),
                f"{prefix}value_accuracy": value_accuracy,
                f"{prefix}by_kind": {k: float(np.mean(v)) for k, v in sorted(per_kind.items())}})
    if not prefix:
      out["example"] = {"expected": tokenizer.decode(targets[0]).strip(),
                        "predicted": predicted[0].strip()}
  return out
