"""The rollout engine interface shared by the in-process JAX engine and the SGLang client.

An engine maps token ids to token ids (token-in / token-out): it never sees text. Each
`Completion` carries exactly the sampled ids and, for each, its log-probability under the
distribution the engine sampled from: log softmax(logits / T) over the FULL vocabulary (T = 1
for greedy) -- the quantity the GRPO trainer recomputes at the same temperature and compares as
`sampler_logp`. top-k / top-p truncation changes which token is drawn, not the reported
logprob; see `bat_jax.rollout.sampling`.

Multi-turn conversations are continued by sending the full token history again with the same
`session_id`: an engine that caches state (the JAX engine's slots, SGLang's radix cache) only
computes the new suffix.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Protocol, Sequence

log = logging.getLogger(__name__)

# Why the engine ended one completion (SGLang's names); a whole rollout's reasons are
# `bat_jax.rollout_protocol.FINISH_REASONS`.
COMPLETION_FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


class PromptTooLongError(ValueError):
  """The prompt (plus at least one new token) does not fit the engine's context."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling settings (SGLang's names and conventions).

  Attributes:
    max_new_tokens: upper bound on generated tokens (the stop token included).
    temperature: 0 means greedy (argmax).
    top_p: nucleus mass in (0, 1]; 1 disables it.
    top_k: keep the k most likely tokens; -1 disables it (0 is refused, as SGLang does).
    min_p: drop tokens whose probability is below min_p times the most likely one's (0: off).
    stop_token_ids: generation ends after emitting any of these (the id is kept in the output).
    seed: per-request sampling seed (SGLang's `sampling_seed`): the token at absolute position
      p is drawn with fold_in(key(seed), p), so the same request and seed give the same tokens
      whatever else is batched with it. None: the engine's own PRNG stream (`reseed`).
  """
  max_new_tokens: int = 256
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  min_p: float = 0.0
  stop_token_ids: tuple[int, ...] = ()
  seed: Optional[int] = None

  def __post_init__(self):
    _check(isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
           and self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens,
           "an integer >= 1")
    _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
           self.temperature, "a number >= 0")
    _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p,
           "a number in (0, 1]")
    # SGLang 0.5.23: "top_k must be -1 (disable) or at least 1"; 0 is refused there, so here.
    _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
           and (self.top_k == -1 or self.top_k >= 1), "top_k", self.top_k,
           "-1 (disable) or at least 1 (SGLang refuses 0)")
    _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p,
           "a number in [0, 1]")
    ids = self.stop_token_ids
    _check(isinstance(ids, tuple) and all(isinstance(t, int) and t >= 0 for t in ids),
           "stop_token_ids", ids, "a tuple of non-negative token ids")
    _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                 and -(1 << 63) <= self.seed < (1 << 64)),
           "seed", self.seed, "None or a 64-bit integer")

  def to_dict(self) -> dict[str, Any]:
    """SGLang `sampling_params` JSON (stop token kept in the output, specials kept in text)."""
    seed = {} if self.seed is None else {"sampling_seed": self.seed}
    return {**seed, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "stop_token_ids": list(self.stop_token_ids),
            "skip_special_tokens": False, "no_stop_trim": True}


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
  """One generation request.

  Attributes:
    input_ids: the full token history [T] (prompt and every earlier turn).
    sampling: sampling settings.
    session_id: conversation key; an engine may reuse cached state for a known session whose
      cached tokens are a prefix of `input_ids`.
    token_mask: optional bool [V]: the tokens the next (only) sampled token may be; a grammar's
      per-step mask (constrained decoding). Needs `sampling.max_new_tokens == 1`. JaxEngine only.
  """
  input_ids: Sequence[int]
  sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  session_id: Optional[str] = None
  token_mask: Any = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Completion:
  """What an engine generated for one request.

  Attributes:
    output_ids: sampled token ids [N] (a final stop token included).
    logprobs: [N] log softmax(logits / T)[token] over the full vocabulary (T = 1 if greedy).
    finish_reason: one of COMPLETION_FINISH_REASONS.
    prompt_tokens: len(input_ids).
    cached_tokens: prompt tokens whose state was reused rather than recomputed.
    weight_version: the params version that produced it.
  """
  output_ids: tuple[int, ...]
  logprobs: tuple[float, ...]
  finish_reason: str
  prompt_tokens: int
  cached_tokens: int = 0
  weight_version: str = ""

  def __post_init__(self):
    if len(self.output_ids) != len(self.logprobs):
      raise ValueError(f"Completion: {len(self.output_ids)} output_ids but "
                       f"{len(self.logprobs)} logprobs")
    if self.finish_reason not in COMPLETION_FINISH_REASONS:
      raise ValueError(f"Completion: unknown finish_reason {self.finish_reason!r}; "
                       f"expected one of {COMPLETION_FINISH_REASONS}")


class Engine(Protocol):
  """A batched token-in / token-out generator."""

  def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
    """Generates for every request; result i answers request i."""
    ...

  def release(self, session_ids: Sequence[str]) -> None:
    """Forgets cached state of finished sessions (a no-op for stateless engines)."""
    ...

  @property
  def weight_version(self) -> str:
    """The version label of the params currently served."""
    ...


def generate_isolated(engine: Engine, requests: Sequence[GenerateRequest]
                      ) -> list[Completion | Exception]:
  """`engine.generate(requests)`; when the batch fails, each request is retried alone so one bad
  request fails only itself. Returns each request's Completion or the exception it raised."""
  try:
    return list(engine.generate(list(requests)))
  except Exception as e:  # pylint: disable=broad-except
    if len(requests) == 1:
      return [e]
    if isinstance(e, PromptTooLongError):  # expected near the end of a conversation
      log.info("a prompt is too long (%s); retrying %d requests one by one", e, len(requests))
    else:
      log.exception("batched generate failed; retrying %d requests one by one", len(requests))
  out: list[Completion | Exception] = []
  for r in requests:
    try:
      out.append(engine.generate([r])[0])
    except Exception as e:  # pylint: disable=broad-except
      out.append(e)
  return out


def _is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, field: str, value: Any, expected: str) -> None:
  if not ok:
    raise ValueError(f"sampling_params.{field} = {value!r} is invalid: expected {expected}")
