"""Request validation for `bat_jax.rollout.server`: typed field readers and the sampling settings.

Every reader refuses a wrong type, a non-finite number or an out-of-range value with a
`RequestError` that names the field, so junk never reaches the engine. `Sampling` is the
server-side view of one request's sampling (what the engine samples with, plus what the server
enforces around it: stop strings, EOS handling, n, logprob detail).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from http import HTTPStatus
from typing import Any, Mapping, Optional, Sequence

from bat_jax.rollout.engine import SamplingParams

log = logging.getLogger("bat_jax.serve")

MAX_N = 64                  # parallel samples per prompt
MAX_BATCH = 256             # prompts x n per request
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20       # OpenAI's limit
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)   # OpenAI: int64; SGLang: any int; both fit here
GREEDY_EPS = 1e-6           # SGLang: temperature below this is greedy
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128


class RequestError(Exception):
  """A client error: HTTP `status` with a message that names the field at fault."""

  def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST):
    super().__init__(message)
    self.status = int(status)


def brief(value: Any, limit: int = 60) -> str:
  """A short repr for error messages (never recursive on deep junk)."""
  if isinstance(value, (list, dict)):
    return f"a JSON {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


def obj(value: Any, field: str) -> dict:
  if not isinstance(value, dict):
    raise RequestError(f"{field} must be a JSON object, got {brief(value)}")
  return value


# A JSON schema (a tool's parameters, a response format) nests at most this deep: rendering,
# serialising and grammar building recurse over it.
MAX_SCHEMA_DEPTH = 64


def nesting(value: Any) -> int:
  """How deep `value`'s dicts and lists nest (iterative: no recursion limit to hit)."""
  deepest, stack = 0, [(value, 1)]
  while stack:
    node, depth = stack.pop()
    if isinstance(node, (dict, list)):
      deepest = max(deepest, depth)
      stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
  return deepest


def shallow_schema(schema: Any, field: str) -> Any:
  """`schema`, refused with a 400 naming `field` when it nests past MAX_SCHEMA_DEPTH."""
  if nesting(schema) > MAX_SCHEMA_DEPTH:
    raise RequestError(f"{field} nests deeper than {MAX_SCHEMA_DEPTH} levels")
  return schema


def no_unknown(body: Mapping, allowed, where: str) -> None:
  unknown = sorted(str(k) for k in set(body) - set(allowed))
  if unknown:
    raise RequestError(f"{where} does not accept field(s) {unknown[:20]}; "
                       f"accepted: {sorted(allowed)}")


def ignore_unknown(body: Mapping, allowed, where: str, warned: set) -> None:
  """vLLM's way with unknown fields: ignore them, logging one warning per field name (per server:
  `warned` is the server's set of names already logged)."""
  for key in sorted(str(k) for k in set(body) - set(allowed)):
    if (where, key) not in warned and len(warned) < 4096:  # bounded: junk names cannot grow it
      warned.add((where, key))
      log.warning("%s: ignoring unknown field %r (further occurrences are not logged)",
                  where, key[:100])


def check_max_tokens(max_tokens: Optional[int], prompt_len: int, max_len: int,
                     what: str) -> None:
  """vLLM's 400 for a max_tokens that cannot fit the context after the prompt."""
  if max_tokens is not None and prompt_len + max_tokens > max_len:
    raise RequestError(
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the "
        f"completion). Please reduce the length of the {what} or completion.")


def number(value: Any, field: str, *, lo: float, hi: float, lo_open: bool = False) -> float:
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if ok:
    value = float(value)
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
  if not ok:
    lo_s = f"({lo}" if lo_open else f"[{lo}"
    raise RequestError(f"{field} = {brief(value)} is invalid: expected a finite number in "
                       f"{lo_s}, {hi}]")
  return value


def integer(value: Any, field: str, *, lo: int, hi: int) -> int:
  if not (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi):
    raise RequestError(f"{field} = {brief(value)} is invalid: expected an integer in "
                       f"[{lo}, {hi}]")
  return value


def boolean(value: Any, field: str) -> bool:
  if not isinstance(value, bool):
    raise RequestError(f"{field} = {brief(value)} is invalid: expected true or false")
  return value


def token_ids(value: Any, field: str, vocab_size: int, *, max_items: int) -> tuple[int, ...]:
  if not isinstance(value, list) or len(value) > max_items:
    raise RequestError(f"{field} must be a list of at most {max_items} token ids, "
                       f"got {brief(value)}")
  for i, t in enumerate(value):
    integer(t, f"{field}[{i}]", lo=0, hi=vocab_size - 1)
  return tuple(value)


def stop_strings(value: Any, field: str) -> tuple[str, ...]:
  """`stop`: a string or a list of strings (OpenAI and SGLang)."""
  if value is None:
    return ()
  items = [value] if isinstance(value, str) else value
  if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS:
    raise RequestError(f"{field} must be a string or a list of at most {MAX_STOP_STRINGS} "
                       f"strings, got {brief(value)}")
  for i, s in enumerate(items):
    if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
      raise RequestError(f"{field}[{i}] must be a non-empty string of at most "
                         f"{MAX_STOP_CHARS} characters, got {brief(s)}")
  return tuple(items)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """One request's sampling, as the server runs it.

  Attributes:
    temperature, top_p, top_k, min_p: the engine's sampler (temperature 0 = greedy; top_k -1
      = off); logprobs are of softmax(logits / temperature) (greedy: temperature 1).
    max_new_tokens: generated-token cap; None = until the context is full.
    stop: stop strings (matched on the decoded text; generation ends at the completing token).
    stop_token_ids: requested stop ids; `eos_token_ids` are added unless `ignore_eos`.
    n: samples per prompt.
    skip_special_tokens, no_stop_trim: how the text is rendered (SGLang semantics).
    top_logprobs: alternatives reported per generated token (0 = none).
    seed: OpenAI `seed` / SGLang `sampling_seed`; None = the engine's PRNG stream (not
      reproducible across batches). Choice i samples with `choice_seed(seed, i)`.
    grammar: constrained decoding (response_format, SGLang json_schema / regex): each token
      is sampled under the grammar's mask (`server.grammar`); None = unconstrained.
  """
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  min_p: float = 0.0
  max_new_tokens: Optional[int] = SGLANG_DEFAULT_MAX_NEW_TOKENS
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  eos_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  n: int = 1
  skip_special_tokens: bool = True
  no_stop_trim: bool = False
  top_logprobs: int = 0
  seed: Optional[int] = None
  grammar: Optional[str] = None   # llguidance grammar of constrained decoding (`grammar`)

  @property
  def engine_stop_ids(self) -> tuple[int, ...]:
    ids = self.stop_token_ids + (() if self.ignore_eos else self.eos_token_ids)
    return tuple(dict.fromkeys(ids))

  @property
  def logprob_temperature(self) -> float:
    """The temperature of the distribution the tokens are drawn from (greedy: 1)."""
    return self.temperature if self.temperature > 0 else 1.0

  def engine_params(self, max_new_tokens: int, vocab_size: int, index: int = 0
                    ) -> SamplingParams:
    """The engine's settings for choice `index` (its own seed when the request has one)."""
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature,
                          top_p=self.top_p, top_k=min(self.top_k, vocab_size),
                          min_p=self.min_p, stop_token_ids=self.engine_stop_ids,
                          seed=choice_seed(self.seed, index))


def choice_seed(seed: Optional[int], index: int) -> Optional[int]:
  """The sampling seed of choice `index` of a request seeded with `seed`.

  Choice 0 keeps the seed (so n = 1 and the first of n agree); the others get a 64-bit hash of
  (seed, index), so the n choices differ and do not collide with a neighbouring seed's choices.
  """
  if seed is None or index == 0:
    return seed
  digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little")


# SGLang 0.5.23 sampling_params fields we implement, and those accepted only at their default
# (penalties, ebnf / structural-tag grammars, logit bias, ...): other values are refused by name.
_SGLANG_ONLY_DEFAULT = {"frequency_penalty": 0.0, "presence_penalty": 0.0,
                        "repetition_penalty": 1.0, "min_new_tokens": 0, "ebnf": None,
                        "structural_tag": None, "stop_regex": None,
                        "custom_params": None, "logit_bias": None}
SGLANG_SAMPLING_FIELDS = frozenset(
    {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "n",
     "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
     "stream_interval", "sampling_seed", "json_schema", "regex"} | set(_SGLANG_ONLY_DEFAULT))


def only_default(body: Mapping, defaults: Mapping[str, Any], where: str) -> None:
  for key, default in defaults.items():
    value = body.get(key)
    if value is not None and value != default and value != {} and value != []:
      raise RequestError(f"{where}{key} = {brief(value)} is not supported by bat_jax.serve "
                         f"(only {default!r})")


def sglang_sampling(d: Any, *, vocab_size: int, eos_token_ids: Sequence[int],
                    max_stop_ids: int, top_logprobs: int = 0) -> Sampling:
  """SGLang `sampling_params` with SGLang's semantics and checks."""
  d = obj({} if d is None else d, "sampling_params")
  no_unknown(d, SGLANG_SAMPLING_FIELDS, "sampling_params")
  only_default(d, _SGLANG_ONLY_DEFAULT, "sampling_params.")
  f = lambda k: f"sampling_params.{k}"  # noqa: E731
  get = lambda k, default: default if d.get(k) is None else d[k]  # noqa: E731  null = default
  kw: dict[str, Any] = {}
  if "max_new_tokens" not in d:
    kw["max_new_tokens"] = SGLANG_DEFAULT_MAX_NEW_TOKENS
  elif d["max_new_tokens"] is None:  # SGLang: until the context is full
    kw["max_new_tokens"] = None
  else:
    kw["max_new_tokens"] = integer(d["max_new_tokens"], f("max_new_tokens"), lo=0, hi=1 << 30)
  kw["temperature"] = number(get("temperature", 1.0), f("temperature"), lo=0.0, hi=1e4)
  if kw["temperature"] < GREEDY_EPS:
    kw["temperature"] = 0.0
  kw["top_p"] = number(get("top_p", 1.0), f("top_p"), lo=0.0, hi=1.0, lo_open=True)
  kw["top_k"] = integer(get("top_k", -1), f("top_k"), lo=-1, hi=1 << 30)
  if kw["top_k"] == 0:
    raise RequestError("sampling_params.top_k = 0 is invalid: expected -1 (off) or >= 1, "
                       "as SGLang")
  kw["min_p"] = number(get("min_p", 0.0), f("min_p"), lo=0.0, hi=1.0)
  kw["n"] = integer(get("n", 1), f("n"), lo=1, hi=MAX_N)
  if d.get("sampling_seed") is not None:
    kw["seed"] = integer(d["sampling_seed"], f("sampling_seed"), lo=SEED_RANGE[0],
                         hi=SEED_RANGE[1])
  for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
              "no_stop_trim"):
    if d.get(key) is not None:
      boolean(d[key], f(key))
  if d.get("stream_interval") is not None:
    integer(d["stream_interval"], f("stream_interval"), lo=1, hi=1 << 20)
  kw["ignore_eos"] = bool(d.get("ignore_eos") or False)
  kw["skip_special_tokens"] = get("skip_special_tokens", True)
  kw["no_stop_trim"] = bool(d.get("no_stop_trim") or False)
  kw["stop"] = stop_strings(d.get("stop"), f("stop"))
  kw["stop_token_ids"] = token_ids(get("stop_token_ids", []), f("stop_token_ids"), vocab_size,
                                   max_items=max_stop_ids)
  sampling = Sampling(eos_token_ids=tuple(eos_token_ids), top_logprobs=top_logprobs, **kw)
  check_stop_ids(sampling, max_stop_ids, f("stop_token_ids"))
  return sampling


def check_stop_ids(sampling: Sampling, max_stop_ids: int, field: str) -> None:
  n = len(sampling.engine_stop_ids)
  if n > max_stop_ids:
    raise RequestError(f"{field}: {n} stop ids (EOS included) exceed this server's "
                       f"max_stop_ids = {max_stop_ids}")
