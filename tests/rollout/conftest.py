"""Session fixtures of the rollout tests: one tiny tokenizer, chat format and model."""

from __future__ import annotations

import pytest

from bat_jax.model import tokenizer as tk
from rollout_fixtures import tiny_model


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
  return tk.train_tokenizer(tk.tiny_corpus(num_docs=120), 600, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
  return tk.load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def chat(tokenizer):
  return tk.ChatFormat.for_model("qwen3_5_text", tokenizer)


@pytest.fixture(scope="session")
def model(tokenizer):
  return tiny_model(len(tokenizer))
