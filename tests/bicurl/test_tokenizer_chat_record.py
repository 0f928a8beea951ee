"""The run's tokenizer folder (copied into every exported policy) records the tool preamble the
policy is trained with, so `python -m bat_jax.serve` on `policies/<name>` renders the same prompt."""

from __future__ import annotations

import json

import pytest

from bat_jax.bicurl import setup
from bat_jax.model import compact_chat
from fast_config import fast_config


@pytest.mark.parametrize("preamble", ["compact", "template"])
def test_prepare_tokenizer_records_the_tool_preamble(preamble, tmp_path):
  cfg = fast_config(tokenizer__tool_preamble=preamble, tokenizer__train__corpus_tasks=4)
  out = setup.prepare_tokenizer(cfg, tmp_path / "tokenizer")
  config = json.loads((out / "tokenizer_config.json").read_text())
  assert config[compact_chat.CHAT_FORMAT_FIELD] == {"tool_preamble": preamble}
  assert compact_chat.recorded_preamble(out) == preamble
  # A run prepared before the record existed gets it on restart (the files are reused).
  del config[compact_chat.CHAT_FORMAT_FIELD]
  (out / "tokenizer_config.json").write_text(json.dumps(config))
  setup.prepare_tokenizer(cfg, out)
  assert compact_chat.recorded_preamble(out) == preamble


def test_every_run_seed_trains_the_same_vocabulary(tmp_path):
  """The tokenizer's corpus follows `tokenizer.train.seed`, not the run's seed: run seeds share
  one vocabulary and so one tiny base (its cache key hashes the tokenizer files); another
  tokenizer seed gives another vocabulary."""
  def vocab(name, **overrides):
    cfg = fast_config(tokenizer__train__corpus_tasks=4, **overrides)
    return (setup.prepare_tokenizer(cfg, tmp_path / name) / "tokenizer.json").read_bytes()
  assert vocab("run0", seed=0) == vocab("run3", seed=3)
  assert vocab("tok1", seed=0, tokenizer__train__seed=1) != vocab("run0b", seed=0)
