"""tests/model's tokenizer: larger than the suite-wide one (1024 ids), trained once per session."""

import pytest

from bat_jax.model import tokenizer as tk
from bat_jax.model import tokenizer_corpus


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
  return tk.train_tokenizer(tokenizer_corpus.tiny_corpus(), 1024, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
  return tk.load_tokenizer(tokenizer_dir)
