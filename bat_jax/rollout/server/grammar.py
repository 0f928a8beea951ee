"""Constrained decoding for `bat_jax.rollout.server`: llguidance grammars -> a token mask per step.

`response_format` (OpenAI: json_object, json_schema) and SGLang's `json_schema` / `regex`
sampling params compile to an llguidance grammar; each generated token is one engine step whose
next-token mask comes from the grammar's matcher (`GenerateRequest.token_mask`). JSON is compact
(no free whitespace), so a generation cannot wander in whitespace. The grammar's tokenizer is
the served HF tokenizer's own vocabulary, with the request's stop ids as its end-of-sequence
tokens: a stop token is allowed exactly when the grammar accepts.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Optional, Sequence

import numpy as np

from bat_jax.rollout.server.params import RequestError, brief, obj, shallow_schema

_JSON_OPTIONS = {"whitespace_flexible": False}
MAX_GRAMMAR_CHARS = 1 << 20


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]):
  import llguidance.hf  # deferred: only constrained requests need it
  return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                      eos_token=list(stop_ids) or None)


class TokenConstraint:
  """One sample's grammar state: `mask()` before each token, `accept(t)` after it."""

  def __init__(self, grammar: str, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]):
    import llguidance
    import llguidance.numpy as llnp
    self._llnp = llnp
    self.vocab_size = vocab_size
    self._matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer, vocab_size, tuple(stop_ids)),
                                         grammar, log_level=0)
    if self._matcher.is_error():
      raise RequestError(f"the grammar does not compile: {self._matcher.get_error()[:500]}")
    self._bits = llnp.allocate_token_bitmask(1, vocab_size)

  def mask(self) -> np.ndarray:
    """bool [V]: the tokens the grammar allows next."""
    self._llnp.fill_next_token_bitmask(self._matcher, self._bits)
    bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
    return bits[:self.vocab_size].astype(bool)

  def accept(self, token: int) -> None:
    if not self._matcher.consume_token(int(token)):
      raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")

  @property
  def finished(self) -> bool:
    """The grammar is complete and takes no more tokens (only a stop token, if any)."""
    return self._matcher.is_stopped()


def check_grammar(grammar: str, field: str) -> str:
  import llguidance
  message = llguidance.LLMatcher.validate_grammar(grammar)
  if message and not message.startswith("WARNING"):
    raise RequestError(f"{field} is not a usable grammar: {message[:500]}")
  return grammar


def json_schema_grammar(schema: Any, field: str) -> str:
  import llguidance
  if isinstance(schema, str):
    try:
      schema = json.loads(schema)
    except json.JSONDecodeError as e:
      raise RequestError(f"{field} is not valid JSON: {e}") from None
  if not isinstance(schema, (dict, bool)):
    raise RequestError(f"{field} must be a JSON schema object, got {brief(schema)}")
  shallow_schema(schema, field)
  if len(json.dumps(schema)) > MAX_GRAMMAR_CHARS:
    raise RequestError(f"{field} is longer than {MAX_GRAMMAR_CHARS} characters")
  try:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
  except ValueError as e:
    raise RequestError(f"{field} is not a usable JSON schema: {e}"[:600]) from None
  return check_grammar(grammar, field)


def response_format_grammar(value: Any) -> Optional[str]:
  """OpenAI `response_format` -> a grammar (None for text)."""
  if value is None:
    return None
  value = obj(value, "response_format")
  kind = value.get("type")
  if kind == "text":
    return None
  if kind == "json_object":
    return json_schema_grammar({"type": "object"}, "response_format")
  if kind == "json_schema":
    spec = obj(value.get("json_schema"), "response_format.json_schema")
    if "schema" not in spec:
      raise RequestError("response_format.json_schema.schema is missing")
    return json_schema_grammar(spec["schema"], "response_format.json_schema.schema")
  raise RequestError(f"response_format.type = {brief(kind)} is invalid: expected 'text', "
                     "'json_object' or 'json_schema'")


def sglang_grammar(params: dict) -> Optional[str]:
  """SGLang sampling_params `json_schema` (a string) or `regex` -> a grammar."""
  import llguidance
  given = [k for k in ("json_schema", "regex") if params.get(k) is not None]
  if len(given) > 1:
    raise RequestError(f"sampling_params: at most one of json_schema, regex; got {given}")
  if not given:
    return None
  if given == ["json_schema"]:
    return json_schema_grammar(params["json_schema"], "sampling_params.json_schema")
  regex = params["regex"]
  if not isinstance(regex, str) or len(regex) > MAX_GRAMMAR_CHARS:
    raise RequestError("sampling_params.regex must be a string")
  return check_grammar(llguidance.LLMatcher.grammar_from_regex(regex),
                       "sampling_params.regex")
