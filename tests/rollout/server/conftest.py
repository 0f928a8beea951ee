"""Session fixtures of the serve tests (helpers: serve_fixtures.py)."""

from __future__ import annotations

import pytest

from serve_fixtures import start, stop, tiny_model


@pytest.fixture(scope="session")
def model(tokenizer):
  return tiny_model(len(tokenizer))


@pytest.fixture(scope="session")
def served(model, tokenizer, chat):
  """(app, base URL) of a server over the random tiny model, named "bat-tiny"."""
  app, httpd, base = start(model, tokenizer, chat, served_name="bat-tiny")
  yield app, base
  stop(app, httpd)
