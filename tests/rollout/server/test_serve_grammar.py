"""The engine's per-step token mask (`GenerateRequest.token_mask`) and the grammar state that
fills it (`server.grammar.TokenConstraint`, llguidance over the served tokenizer)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bat_jax.rollout.engine import GenerateRequest, SamplingParams
from bat_jax.rollout.jax_engine import JaxEngine
from bat_jax.rollout.server.grammar import TokenConstraint, response_format_grammar
from bat_jax.rollout.server.params import RequestError
from serve_fixtures import ENGINE


def test_token_mask_forces_the_only_allowed_token_and_bad_masks_are_refused(model):
  engine = JaxEngine(model, ENGINE)
  vocab = engine.vocab_size
  one = SamplingParams(max_new_tokens=1, temperature=1.0, seed=5)
  for forced in (7, 311):
    mask = np.zeros(vocab, bool)
    mask[forced] = True
    [out] = engine.generate([GenerateRequest([1, 2, 3], one, token_mask=mask)])
    assert out.output_ids == (forced,) and out.logprobs[0] == pytest.approx(0.0, abs=1e-5)
  free = engine.generate([GenerateRequest([1, 2, 3], one)])[0]
  assert len(free.output_ids) == 1   # an unmasked request next to it is unaffected
  with pytest.raises(ValueError, match="max_new_tokens must be 1"):
    engine.generate([GenerateRequest([1], SamplingParams(max_new_tokens=2),
                                     token_mask=np.ones(vocab, bool))])
  with pytest.raises(ValueError, match="allows no token"):
    engine.generate([GenerateRequest([1], one, token_mask=np.zeros(vocab, bool))])
  with pytest.raises(ValueError, match="shape"):
    engine.generate([GenerateRequest([1], one, token_mask=np.ones(vocab + 1, bool))])


def test_constraint_walk_yields_valid_json_and_bad_schemas_name_the_field(tokenizer):
  schema = {"type": "object", "required": ["k"], "additionalProperties": False,
            "properties": {"k": {"enum": ["x", "yy"]}}}
  grammar = response_format_grammar({"type": "json_schema", "json_schema": {"schema": schema}})
  rng = np.random.default_rng(0)
  for _ in range(5):
    c, out = TokenConstraint(grammar, tokenizer, len(tokenizer), (tokenizer.eos_token_id,)), []
    while not c.finished and len(out) < 50:
      allowed = np.flatnonzero(c.mask())
      assert allowed.size > 0
      out.append(int(rng.choice(allowed)))
      c.accept(out[-1])
    text = tokenizer.decode([t for t in out if t != tokenizer.eos_token_id])
    assert json.loads(text)["k"] in ("x", "yy")
  assert response_format_grammar({"type": "text"}) is None
  with pytest.raises(RequestError, match="response_format.json_schema.schema is missing"):
    response_format_grammar({"type": "json_schema", "json_schema": {}})
