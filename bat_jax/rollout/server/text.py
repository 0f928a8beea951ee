"""Text around generated tokens: stop strings, incremental (streamed) decoding, top logprobs.

Top logprobs are re-scored from the served params: one forward pass over prompt + output,
logits / temperature (greedy: 1), log-softmax, top-k. The forward is jitted on padded lengths
(right padding never changes earlier positions of a causal model), so lengths share
compilations by power-of-two bucket.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

CALL_OPEN = "<tool_call>"


def find_stop(tokenizer: Any, ids: Sequence[int], stops: Sequence[str],
              skip_special_tokens: bool) -> Optional[tuple[int, str]]:
  """(tokens to keep, matched stop string) for the first stop string in decode(ids), or None.

  The kept prefix ends with the token that completes the match (SGLang keeps it in
  output_ids); the smallest such prefix is found by bisection.
  """
  decode = lambda k: tokenizer.decode(list(ids[:k]), skip_special_tokens=skip_special_tokens)  # noqa: E731
  text = decode(len(ids))
  hits = [(text.find(s), s) for s in stops if s in text]
  if not hits:
    return None
  _, stop = min(hits)
  lo, hi = 1, len(ids)
  while lo < hi:  # smallest k with `stop` in decode(k): containment is monotone in k
    mid = (lo + hi) // 2
    if stop in decode(mid):
      hi = mid
    else:
      lo = mid + 1
  return lo, stop


def trim_at_stop(text: str, finish: Optional[dict]) -> str:
  """The text cut where its matched stop string starts (OpenAI; SGLang without no_stop_trim)."""
  matched = (finish or {}).get("matched")
  if isinstance(matched, str) and matched in text:
    return text[:text.find(matched)]
  return text


class StreamText:
  """Decodes a growing token list and releases only text that cannot change any more.

  Held back: an incomplete UTF-8 tail, anything that could still become a stop string, and,
  when tool calls are parsed, everything from a (possibly partial) `<tool_call>` on.
  """

  def __init__(self, tokenizer: Any, *, stops: Sequence[str] = (), hold_tool_calls: bool,
               hold_all: bool = False, skip_special_tokens: bool = True):
    self.tokenizer = tokenizer
    self.stops = tuple(stops)
    self.hold_tool_calls = hold_tool_calls
    self.hold_all = hold_all
    self.skip_special_tokens = skip_special_tokens
    self.ids: list[int] = []
    self.sent = 0  # characters already released

  def text(self) -> str:
    return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

  def feed(self, new_ids: Sequence[int]) -> str:
    self.ids.extend(int(t) for t in new_ids)
    text = self.text()
    safe = 0 if self.hold_all else len(text)
    if text.endswith("\ufffd"):
      safe = min(safe, len(text.rstrip("\ufffd")))
    for stop in self.stops:
      safe = min(safe, _partial_start(text, stop))
    if self.hold_tool_calls:
      safe = min(safe, _partial_start(text, CALL_OPEN))
    return self._release(text, safe)

  def finish(self, finish: Optional[dict], upto_call: bool = False) -> str:
    """The rest of the text (cut at a matched stop string; before `<tool_call>` if asked)."""
    text = trim_at_stop(self.text(), finish)
    end = text.find(CALL_OPEN) if upto_call and CALL_OPEN in text else len(text)
    return self._release(text, end)

  def _release(self, text: str, end: int) -> str:
    if end <= self.sent:
      return ""
    out, self.sent = text[self.sent:end], end
    return out


def _partial_start(text: str, marker: str) -> int:
  """Where `marker`, or a prefix of it at the very end of text, starts (len(text) if nowhere)."""
  at = text.find(marker)
  if at >= 0:
    return at
  for k in range(min(len(marker) - 1, len(text)), 0, -1):
    if text.endswith(marker[:k]):
      return len(text) - k
  return len(text)


def _bucket(n: int, floor: int = 16) -> int:
  return max(floor, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _top_logprobs(graphdef, params, ids, start, rows: int, k: int, temperature):
  """ids [1, L]; rows start .. start + rows - 1 predict the output -> ([rows, k], [rows, k])."""
  model = nnx.merge(graphdef, params)
  hidden = model.hidden_states(ids)[0]                                  # [L, D]
  h = jax.lax.dynamic_slice_in_dim(hidden, start, rows, axis=0)         # [rows, D]
  logits = jnp.einsum("rd,dv->rv", h, model.unembed_kernel(),
                      preferred_element_type=jnp.float32) / temperature
  return jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)


def top_logprobs(graphdef, params, prompt: Sequence[int], output: Sequence[int], k: int,
                 temperature: float) -> list[list[tuple[int, float]]]:
  """Per output token, the k most likely tokens and their logprobs at `temperature`."""
  ids = list(prompt) + list(output)
  start, rows = len(prompt) - 1, _bucket(len(output))
  length = _bucket(max(len(ids), start + rows))  # the slice never clamps
  padded = np.zeros((1, length), np.int32)
  padded[0, :len(ids)] = ids
  vals, idx = _top_logprobs(graphdef, params, jnp.asarray(padded), jnp.int32(start), rows,
                            int(k), jnp.float32(temperature))
  vals, idx = np.asarray(vals), np.asarray(idx)
  return [[(int(idx[r, j]), float(vals[r, j])) for j in range(k)] for r in range(len(output))]


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningSplit:
  """Splits an assistant turn into `reasoning_content` and `content` (vLLM's Qwen3 reasoning
  parser): what precedes `</think>` is reasoning when the turn opens `<think>` itself, or when
  the prompt opened it (`opened`) and the turn closes it; a turn that never closes the prompt's
  block is all content (Qwen3 with thinking switched off by the model). The newlines after
  `</think>` are dropped. Fed in pieces (streaming) it holds back what is not decided yet (a
  partial tag; after an opened prompt, the text until `</think>`); `final=True` releases all."""

  def __init__(self, opened: bool):
    self.mode = "opened" if opened else "start"
    self.pending = ""

  def feed(self, text: str, final: bool = False) -> tuple[str, str]:
    """(reasoning, content) that this piece releases."""
    self.pending += text
    reasoning = content = ""
    while self.pending:
      if self.mode == "opened":
        if THINK_CLOSE in self.pending:
          self.mode = "reasoning"
          continue
        if final:
          self.mode = "content"
          continue
        break
      if self.mode == "start":
        head = self.pending.lstrip()
        if head.startswith(THINK_OPEN):
          self.pending, self.mode = head[len(THINK_OPEN):], "reasoning"
          continue
        if not final and THINK_OPEN.startswith(head):  # may still become <think>
          break
        self.mode = "content"
      elif self.mode == "reasoning":
        at = self.pending.find(THINK_CLOSE)
        if at >= 0:
          reasoning += self.pending[:at]
          self.pending, self.mode = self.pending[at + len(THINK_CLOSE):], "after"
          continue
        keep = 0 if final else len(self.pending) - _partial_start(self.pending, THINK_CLOSE)
        reasoning += self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        break
      elif self.mode == "after":
        self.pending = self.pending.lstrip("\n")
        if self.pending:
          self.mode = "content"
      else:
        content, self.pending = content + self.pending, ""
    return reasoning, content


def split_reasoning(text: str, opened: bool) -> tuple[Optional[str], str]:
  """(reasoning or None when the turn has no reasoning block, content) of a whole turn."""
  split = ReasoningSplit(opened)
  reasoning, content = split.feed(text, final=True)
  had = (opened and THINK_CLOSE in text) or text.lstrip().startswith(THINK_OPEN)
  return (reasoning if had else None), content


def _byte_level_decoder() -> dict[str, int]:
  """Byte-level BPE's printable stand-in character of each byte (GPT-2), reversed."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  others = [b for b in range(256) if b not in printable]
  table = {chr(b): b for b in printable}
  table.update({chr(256 + i): b for i, b in enumerate(others)})
  return table


_BYTE_DECODER = _byte_level_decoder()


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
  """A token's raw bytes (also for a piece of a multi-byte UTF-8 character), from the
  byte-level BPE vocabulary; added/special tokens are their UTF-8 text."""
  piece = tokenizer.convert_ids_to_tokens(int(token_id))
  if piece is None:
    return b""
  if any(c not in _BYTE_DECODER for c in piece):  # an added token outside the byte alphabet
    return piece.encode("utf-8")
  return bytes(_BYTE_DECODER[c] for c in piece)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _position_scores(graphdef, params, ids, k: int):
  """ids [1, L] -> (logprob of ids[t + 1] after row t [L], top-k logprobs and ids [L, k]) at
  temperature 1 (the last row's own logprob is junk: nothing follows it)."""
  model = nnx.merge(graphdef, params)
  hidden = model.hidden_states(ids)[0]                                  # [L, D]
  logp = jax.nn.log_softmax(jnp.einsum("ld,dv->lv", hidden, model.unembed_kernel(),
                                       preferred_element_type=jnp.float32), axis=-1)
  following = jnp.concatenate([ids[0, 1:], ids[0, :1]])                 # [L]
  own = jnp.take_along_axis(logp, following[:, None], axis=1)[:, 0]
  vals, idx = jax.lax.top_k(logp, k)
  return own, vals, idx


def prompt_logprobs(graphdef, params, ids: Sequence[int], k: int
                    ) -> list[Optional[tuple[float, list[tuple[int, float]]]]]:
  """Per token of ids: None for the first, else (its logprob given the tokens before it, the k
  most likely tokens there with their logprobs); vLLM's `prompt_logprobs` (temperature 1)."""
  length = _bucket(len(ids))
  padded = np.zeros((1, length), np.int32)
  padded[0, :len(ids)] = ids
  own, vals, idx = jax.device_get(_position_scores(graphdef, params, jnp.asarray(padded),
                                                   max(int(k), 1)))
  return [None] + [(float(own[r]), [(int(idx[r, j]), float(vals[r, j])) for j in range(k)])
                   for r in range(len(ids) - 1)]
