"""The tiny base's copy probe: teacher-forced greedy copying, alone and deep in a long row."""

import jax
import numpy as np

from bat_jax.model import tokenizer as tokenizer_lib
from bat_jax.pretrain import corpus
from bat_jax.pretrain import probe as probe_lib
from base_helpers import HF, build as _build, pcfg as _pcfg


def test_the_probe_scores_each_target_token_against_the_models_next_token(tokenizer_dir,
                                                                         tmp_path, monkeypatch):
  """Teacher-forced probe: a model whose next token is always right scores 1.0 (long repeated
  lists included, which a fixed 48-token decode budget cut short); one wrong token in a call
  fails that call and only that one; an argmax shifted by one position scores 0."""
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
  pcfg = _pcfg(tmp_path, probes=24)
  docs = corpus.documents(pcfg.seed + probe_lib.PROBE_SEED_OFFSET, 0, pcfg.probes)
  encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
  assert max(len(encode(corpus.plain_text(d)[1])) for d in docs) > 48   # a long list is probed
  oracle = lambda model, tokens, lengths: np.roll(tokens, -1, axis=1)     # the true next token
  monkeypatch.setattr(probe_lib, "next_token_argmax", oracle)
  probe = probe_lib.probe_copy(None, tokenizer, pcfg, 0)
  assert probe["copy_accuracy"] == 1.0 and probe["value_accuracy"] == 1.0
  assert probe["example"]["predicted"] == probe["example"]["expected"]

  first = encode(corpus.plain_text(docs[0])[0])    # document 0's context, then its call

  def one_wrong(model, tokens, lengths):
    out = oracle(model, tokens, lengths)
    out[0, len(first) + 2] = (out[0, len(first) + 2] + 1) % len(tokenizer)   # inside the call
    return out

  monkeypatch.setattr(probe_lib, "next_token_argmax", one_wrong)
  probe = probe_lib.probe_copy(None, tokenizer, pcfg, 0)
  assert probe["copy_accuracy"] == (pcfg.probes - 1) / pcfg.probes
  monkeypatch.setattr(probe_lib, "next_token_argmax", lambda m, t, l: t)       # off by one
  assert probe_lib.probe_copy(None, tokenizer, pcfg, 0)["copy_accuracy"] == 0.0


def test_next_token_argmax_at_each_position_is_the_greedy_next_token_of_its_prefix():
  """The teacher-forced probe rests on causality: the argmax at position p of one forward pass
  over the whole row is the token greedy decoding would emit after the prefix up to p (checked
  against a forward over the prefix alone, on a real model with attention and DeltaNet layers,
  rows of different lengths padded in one batch)."""
  model = _build()
  rng = np.random.default_rng(0)
  lengths = np.array([20, 9])
  tokens = rng.integers(3, HF["vocab_size"], size=(2, 20)).astype(np.int32)   # [P, W]
  argmax = probe_lib.next_token_argmax(model, tokens, lengths)
  assert argmax.shape == tokens.shape
  forward = jax.jit(lambda t: model(t))   # op-by-op, four prefixes took ~20 s
  for i, length in enumerate(lengths):
    for p in (length // 2, length - 1):
      prefix = tokens[i:i + 1, :p + 1]
      logits = np.asarray(forward(jax.numpy.asarray(prefix)))                    # [1, p+1, V]
      assert argmax[i, p] == logits[0, -1].argmax(), (i, p)


def test_the_deep_probe_copies_the_same_calls_after_other_documents(tokenizer_dir, tmp_path,
                                                                    monkeypatch):
  """`probe_depth`: each probe document follows at least that many tokens of whole other
  documents; its context and call are unchanged, so an oracle scores 1.0 there too, and a model
  that copies only near the start of a row (right before position 300, wrong after) scores the
  shallow probe 1.0 and the deep one 0."""
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
  cfg = _pcfg(tmp_path, probes=8, probe_depth=400)
  docs = corpus.documents(cfg.seed + probe_lib.PROBE_SEED_OFFSET, 0, cfg.probes)
  contexts, targets = probe_lib._probe_rows(  # pylint: disable=protected-access
      tokenizer, docs, 0, 400, 77)
  encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
  for doc, context, target in zip(docs, contexts, targets):
    own_context, call = (encode(t) for t in corpus.plain_text(doc))
    assert context[-len(own_context):] == own_context and target == call
    prefix = context[:-len(own_context)]
    assert len(prefix) >= 400 and prefix[-1] == 0          # whole documents, each ending in eot
    assert len(prefix) < 400 + 400                          # ... and not many more
  oracle = lambda model, tokens, lengths: np.roll(tokens, -1, axis=1)

  def shallow_only(model, tokens, lengths):
    out = oracle(model, tokens, lengths)
    out[:, 300:] = (out[:, 300:] + 1) % len(tokenizer)
    return out

  monkeypatch.setattr(probe_lib, "next_token_argmax", oracle)
  probe = probe_lib.probe_copy(None, tokenizer, cfg, 0)
  assert probe["copy_accuracy"] == probe["deep_copy_accuracy"] == 1.0
  assert probe["probe_depth"] == 400 and set(probe["deep_by_kind"]) == set(probe["by_kind"])
  monkeypatch.setattr(probe_lib, "next_token_argmax", shallow_only)
  probe = probe_lib.probe_copy(None, tokenizer, cfg, 0)
  assert probe["copy_accuracy"] == 1.0 and probe["deep_copy_accuracy"] == 0.0
  assert probe["deep_value_accuracy"] < 0.5
  shallow = probe_lib.probe_copy(None, tokenizer, _pcfg(tmp_path, probes=8), 0)
  assert "deep_copy_accuracy" not in shallow and shallow["probe_depth"] == 0
