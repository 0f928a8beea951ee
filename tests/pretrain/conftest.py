"""The tiny base's tests use a tokenizer with its reserved echo separators, as setup trains for
`model.source = "tiny_base"`."""

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
  from bat_jax.model import tokenizer as tk
  from bat_jax.model import tokenizer_corpus
  return tk.train_tokenizer(tokenizer_corpus.tiny_corpus(num_docs=120), 600,
                            tmp_path_factory.mktemp("tok"), reserved=tk.PRETRAIN_TOKENS)
