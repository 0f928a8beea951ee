"""In-process JAX rollout engine: batched chunked prefill + jitted decode over fixed-shape slots.

Design
------
The engine owns one model cache of `num_slots` rows x `max_len` tokens (KV for attention
layers, recurrent + conv state for DeltaNet layers; see `model.init_cache`). A conversation
lives in a slot; continuing it with the same `session_id` (or, without one, with a prompt that
extends an anonymous slot's tokens) prefills only the new suffix, so multi-turn rollouts never
recompute their prefix. Rows that are not part of a call are fed `valid=False`, which by the
model contract leaves their state untouched, so every compiled function sees the same shapes:

* `prefill`: tokens [S, C] per chunk (right padded, `valid` mask), fed a row at a time to the
  slots that have new tokens -> the logits of each row's last valid token; one compilation
  per chunk size and span.
* `decode`: a `lax.while_loop` of up to `decode_block` steps (sample -> logprob -> feed the
  token) that stops early when every row is done; one compilation.
* `reset`: zeroes the state of the rows that start a new conversation.

Reported logprobs are log softmax(logits / T) over the full vocabulary (T = 1 for greedy), the
distribution the sampler drew from, with logits from `model.hidden_states` and
`model.unembed_kernel()` exactly like the trainer; see `bat_jax.rollout.sampling`.

Params are swapped in place (`update_params`); cached sessions are dropped because their
state was computed with the old weights (SGLang flushes its cache for the same reason).

Multi-host: each host runs its own engine on its own rollouts (nothing is collective during a
rollout); the engine jits on whatever shardings its params carry, so it runs on a host's local
shards unchanged. `bicurl.multihost` splits the rows (whole state_id groups per host). Only the
single-host engine is tested (CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bat_jax.rollout import engine_programs as programs
from bat_jax.rollout.engine import Completion, GenerateRequest, PromptTooLongError
from bat_jax.rollout.sampling import seed_key_data

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class JaxEngineConfig:
  """Static sizes of the engine (each one fixes a compiled shape).

  Attributes:
    num_slots: conversations held at once (cache batch rows).
    max_len: tokens per slot: prompt + every turn + generated tokens.
    prefill_chunk: the largest number of tokens per prefill call. Shorter suffixes (a tool
      observation, typically) use the smallest of the buckets 32, 128, 512, ... below it that
      holds them, so a 50-token delta does not pay for a 2048-token chunk.
    decode_block: decode steps per compiled call before control returns to Python.
    max_stop_ids: stop token ids per request.
    cache_dtype: dtype of the KV / recurrent cache.
    seed: PRNG seed of the sampler.
  """
  num_slots: int = 8
  max_len: int = 2048
  prefill_chunk: int = 128
  decode_block: int = 128
  max_stop_ids: int = 8
  cache_dtype: Any = jnp.float32
  seed: int = 0

  def __post_init__(self):
    for name in ("num_slots", "max_len", "prefill_chunk", "decode_block", "max_stop_ids"):
      if getattr(self, name) < 1:
        raise ValueError(f"JaxEngineConfig.{name} = {getattr(self, name)} must be >= 1")

  @property
  def prefill_buckets(self) -> tuple[int, ...]:
    """Chunk sizes the prefill compiles for (each one compiled on first use)."""
    sizes, size = [], 32
    while size < self.prefill_chunk:
      sizes.append(size)
      size *= 4
    return tuple(sizes) + (self.prefill_chunk,)

  def chunk_for(self, remaining: int) -> int:
    """The smallest bucket that holds `remaining` tokens (else the largest)."""
    return next((b for b in self.prefill_buckets if b >= remaining), self.prefill_chunk)

  @property
  def span_buckets(self) -> tuple[int, ...]:
    """Cache spans attention reads (`hidden_states(attend_span=)`): 512 times 1, 1.5, 2, 3,
    4, ... up to `max_len`, so a call reads at most 1.5x the slots its rows hold past 512.
    Each span is one more compile per prefill chunk and of the decode, paid on first use: finer
    spans would read less and compile more."""
    sizes, size = [], 512
    while size < self.max_len:
      sizes += [size, 3 * size // 2]
      size *= 2
    return tuple(b for b in sizes if b < self.max_len) + (self.max_len,)

  def span_for(self, needed: int) -> int:
    """The smallest span that holds `needed` cache slots."""
    return next(b for b in self.span_buckets if b >= min(needed, self.max_len))


@dataclasses.dataclass
class _Slot:
  tokens: tuple[int, ...]         # exactly the tokens whose state is in the cache row
  session_id: Optional[str] = None
  last_used: int = 0


class JaxEngine:
  """Token-in / token-out generation with the policy model in this process."""

  def __init__(self, model: nnx.Module, config: JaxEngineConfig = JaxEngineConfig(), *,
               weight_version: str = "0"):
    self.config = config
    self._graphdef, self._params = nnx.split(model)
    self._weight_version = str(weight_version)
    self._slots: list[Optional[_Slot]] = [None] * config.num_slots
    self._clock = itertools.count(1)
    self._key = self._committed(jax.random.key(config.seed))
    # Module-level jits keyed on (graphdef, config): engines of the same model share them.
    static = (self._graphdef, config)
    self._reset = functools.partial(programs.reset_rows, *static)
    self._prefill = functools.partial(programs.prefill_rows, *static)
    self._decode = functools.partial(programs.decode_block, *static)
    self._cache = self._committed(programs.init_cache(*static, self._params))
    self.vocab_size = int(model.unembed_kernel().shape[-1])
    self._lengths = np.zeros(config.num_slots, np.int32)          # tokens in each cache row
    self._last_logits = self._committed(
        jnp.zeros((config.num_slots, self.vocab_size), jnp.float32))

  def _committed(self, tree: Any) -> Any:
    """`tree` committed to the params' device(s), replicated.

    The compiled programs return committed arrays; fed back next call, they key another
    compilation than the uncommitted arrays `jnp.zeros` / `jax.random.key` make, so without
    this every program (prefill buckets, decode, reset) compiled twice per process: ~28 CPU s
    for the perf model, paid inside the first timed generate of every benchmark.
    """
    first = jax.tree.leaves(self._params)[0]
    if not first.committed:  # uncommitted params: the programs' outputs stay uncommitted too
      return tree
    devices = sorted(first.sharding.device_set, key=lambda d: d.id)
    if len(devices) == 1:
      return jax.device_put(tree, jax.sharding.SingleDeviceSharding(devices[0]))
    mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

  # -- public API ------------------------------------------------------------------------------

  @property
  def weight_version(self) -> str:
    return self._weight_version

  @property
  def params(self):
    return self._params

  def update_params(self, new: nnx.Module | nnx.State, weight_version: str) -> None:
    """Swaps params in place (same structure and shapes) and drops every cached session."""
    state = nnx.split(new)[1] if isinstance(new, nnx.Module) else new
    old_leaves = jax.tree_util.tree_leaves_with_path(self._params)
    new_leaves = jax.tree_util.tree_leaves_with_path(state)
    if len(old_leaves) != len(new_leaves):
      raise ValueError(f"update_params: new params have {len(new_leaves)} arrays, the engine "
                       f"serves {len(old_leaves)}")
    for (path, old), (new_path, leaf) in zip(old_leaves, new_leaves):
      name = jax.tree_util.keystr(path)
      if path != new_path or old.shape != leaf.shape:
        raise ValueError(f"update_params: {jax.tree_util.keystr(new_path)} {leaf.shape} does "
                         f"not match the served {name} {old.shape}")
    shardings = jax.tree.map(lambda x: x.sharding, self._params)
    self._params = jax.tree.map(
        lambda x, old, s: jax.device_put(x.astype(old.dtype), s), state, self._params,
        shardings)
    self._weight_version = str(weight_version)
    self.flush()

  def reseed(self, seed: int) -> None:
    """Restarts the sampler's PRNG stream, so a resumed run can replay the same samples."""
    self._key = self._committed(jax.random.key(seed))

  def flush(self) -> None:
    """Forgets every cached conversation (the next call prefills from scratch)."""
    self._slots = [None] * self.config.num_slots

  def release(self, session_ids: Sequence[str]) -> None:
    drop = set(session_ids)
    for i, slot in enumerate(self._slots):
      if slot is not None and slot.session_id in drop:
        self._slots[i] = None

  def check_prompt(self, input_ids: Sequence[int], field: str = "input_ids") -> None:
    """Raises PromptTooLongError / ValueError for a prompt this engine cannot serve."""
    if len(input_ids) == 0:
      raise ValueError(f"{field} is empty")
    if len(input_ids) >= self.config.max_len:
      # SGLang 0.5.23's wording (TokenizerManager._validate_one_request), so the HTTP server's
      # (`bat_jax.rollout.server`) HTTP 400 reads like SGLang's and the client maps both to PromptTooLongError.
      raise PromptTooLongError(
          f"The input ({len(input_ids)} tokens) is longer than the model's context length "
          f"({self.config.max_len} tokens): {field} has {len(input_ids)} tokens and a "
          f"sequence holds prompt + generation, so the prompt must be "
          f"<= {self.config.max_len - 1}")
    bad = [t for t in input_ids if not 0 <= int(t) < self.vocab_size]
    if bad:
      raise ValueError(f"{field} holds token id(s) {bad[:5]} outside [0, {self.vocab_size})")

  def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
    for i, req in enumerate(requests):
      self.check_prompt(req.input_ids, f"requests[{i}].input_ids")
      if len(req.sampling.stop_token_ids) > self.config.max_stop_ids:
        raise ValueError(f"requests[{i}].sampling.stop_token_ids has "
                         f"{len(req.sampling.stop_token_ids)} ids; max_stop_ids is "
                         f"{self.config.max_stop_ids}")
      if req.token_mask is not None:
        _check_token_mask(req, self.vocab_size, f"requests[{i}]")
    results: list[Optional[Completion]] = [None] * len(requests)
    order = list(range(len(requests)))
    for start in range(0, len(order), self.config.num_slots):
      wave = order[start:start + self.config.num_slots]
      for i, completion in zip(wave, self._generate_wave([requests[i] for i in wave])):
        results[i] = completion
    return results

  # -- one wave: at most num_slots requests -----------------------------------------------------

  def _assign_slots(self, wave: Sequence[GenerateRequest]) -> list[tuple[int, int]]:
    """Picks a slot per request; returns (slot, cached_prefix_len) pairs."""
    taken: set[int] = set()
    plan: list[Optional[tuple[int, int]]] = [None] * len(wave)
    for i, req in enumerate(wave):  # first, reuse: the same session or an anonymous prefix
      best, ids = None, tuple(req.input_ids)
      for s, slot in enumerate(self._slots):
        if slot is None or s in taken or slot.session_id != req.session_id:
          continue
        n = len(slot.tokens)
        if n <= len(ids) and ids[:n] == slot.tokens:
          if best is None or n > best[1]:
            best = (s, n)
      if best is not None:
        plan[i] = best
        taken.add(best[0])
    for i, req in enumerate(wave):  # then, fresh slots: empty first, else least recently used
      if plan[i] is not None:
        continue
      free = [s for s in range(self.config.num_slots) if s not in taken]
      s = min(free, key=lambda s: -1 if self._slots[s] is None else self._slots[s].last_used)
      plan[i] = (s, 0)
      taken.add(s)
    return plan  # type: ignore[return-value]

  def _generate_wave(self, wave: Sequence[GenerateRequest]) -> list[Completion]:
    cfg = self.config
    plan = self._assign_slots(wave)
    rows = np.zeros(cfg.num_slots, bool)
    reset_rows = np.zeros(cfg.num_slots, bool)
    deltas: dict[int, list[int]] = {}
    for (s, cached), req in zip(plan, wave):
      rows[s] = True
      if cached == 0:
        reset_rows[s] = True
        self._lengths[s] = 0
      deltas[s] = [int(t) for t in req.input_ids[cached:]]
    if reset_rows.any():
      self._cache = self._reset(self._params, self._cache, jnp.asarray(reset_rows))
    self._prefill_deltas(deltas)
    self._mask_next_tokens(plan, wave)

    temperature = np.ones(cfg.num_slots, np.float32)
    top_p = np.ones(cfg.num_slots, np.float32)
    top_k = np.full(cfg.num_slots, -1, np.int32)
    min_p = np.zeros(cfg.num_slots, np.float32)
    stop_ids = np.full((cfg.num_slots, cfg.max_stop_ids), -1, np.int32)
    budget = np.zeros(cfg.num_slots, np.int32)
    seed_data = np.zeros((cfg.num_slots, 2), np.uint32)   # per-request seeds (SamplingParams.seed)
    seeded = np.zeros(cfg.num_slots, bool)
    for (s, _), req in zip(plan, wave):
      sp = req.sampling
      temperature[s], top_p[s], top_k[s], min_p[s] = (sp.temperature, sp.top_p, sp.top_k,
                                                      sp.min_p)
      stop_ids[s, :len(sp.stop_token_ids)] = sp.stop_token_ids
      budget[s] = min(sp.max_new_tokens, cfg.max_len - int(self._lengths[s]))
      if sp.seed is not None:
        seed_data[s], seeded[s] = seed_key_data(sp.seed), True
    outputs = self._decode_all(rows, budget, temperature, top_p, top_k, min_p, stop_ids,
                               seed_data, seeded)

    completions = []
    for (s, cached), req in zip(plan, wave):
      toks, logps = outputs[s]
      stop = set(req.sampling.stop_token_ids)
      reason = "stop" if toks and toks[-1] in stop else "length"
      slot_tokens = tuple(int(t) for t in req.input_ids) + tuple(toks)
      self._slots[s] = _Slot(slot_tokens, req.session_id, next(self._clock))
      completions.append(Completion(
          output_ids=tuple(toks), logprobs=tuple(logps), finish_reason=reason,
          prompt_tokens=len(req.input_ids), cached_tokens=cached,
          weight_version=self._weight_version))
    return completions

  def _prefill_deltas(self, deltas: dict[int, list[int]]) -> None:
    """Feeds each slot's new tokens in chunks of C tokens. Each call takes the slots whose next
    piece needs the same chunk size (a 500-token prompt and a 60-token observation go in
    separate calls), a row at a time on the device."""
    cfg = self.config
    fed = {s: 0 for s, d in deltas.items() if d}   # slot -> tokens fed so far
    while fed:
      by_chunk: dict[int, list[int]] = {}
      for s, done in fed.items():
        by_chunk.setdefault(cfg.chunk_for(len(deltas[s]) - done), []).append(s)
      for chunk, slots in sorted(by_chunk.items(), reverse=True):
        for s, n in zip(slots, self._prefill_call(chunk, slots, deltas, fed)):
          fed[s] += n
      fed = {s: done for s, done in fed.items() if done < len(deltas[s])}

  def _prefill_call(self, chunk: int, slots: list[int], deltas: dict[int, list[int]],
                    fed: dict[int, int]) -> list[int]:
    """One prefill call of `chunk` tokens per row over `slots`; returns the tokens fed each."""
    cfg = self.config
    n = len(slots)
    rows = np.zeros(cfg.num_slots, np.int32)
    rows[:n] = slots
    tokens = np.zeros((cfg.num_slots, chunk), np.int32)
    valid = np.zeros((cfg.num_slots, chunk), bool)
    last_idx = np.full(cfg.num_slots, -1, np.int32)
    for r, s in enumerate(slots):
      piece = deltas[s][fed[s]:fed[s] + chunk]
      tokens[r, :len(piece)] = piece
      valid[r, :len(piece)] = True
      if fed[s] + len(piece) == len(deltas[s]):
        last_idx[r] = len(piece) - 1
    counts = valid.sum(axis=1).astype(np.int32)[:n]
    lengths = self._lengths[slots]
    positions = np.zeros((cfg.num_slots, chunk), np.int32)
    positions[:n] = lengths[:, None] + np.arange(chunk, dtype=np.int32)[None, :]
    span = cfg.span_for(int((lengths + counts).max()))
    self._cache, self._last_logits = self._prefill(
        span, self._params, self._cache, self._last_logits, jnp.asarray(rows), jnp.int32(n),
        jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(positions), jnp.asarray(last_idx))
    self._lengths[slots] += counts
    return [int(c) for c in counts]

  def _mask_next_tokens(self, plan, wave: Sequence[GenerateRequest]) -> None:
    """Constrained decoding: tokens outside a request's token_mask cannot be sampled next."""
    masked = [(s, req.token_mask) for (s, _), req in zip(plan, wave)
              if req.token_mask is not None]
    if not masked:
      return
    allowed = np.ones((self.config.num_slots, self.vocab_size), bool)   # [S, V]
    for s, mask in masked:
      allowed[s] = mask
    self._last_logits = jnp.where(jnp.asarray(allowed), self._last_logits, -jnp.inf)

  def _decode_all(self, rows, budget, temperature, top_p, top_k, min_p, stop_ids, seed_data,
                  seeded) -> dict[int, tuple[list[int], list[float]]]:
    """Decodes blocks until every row stopped or ran out of budget."""
    active = rows & (budget > 0)
    outputs = {int(s): ([], []) for s in np.flatnonzero(rows)}
    args = [jnp.asarray(a) for a in (temperature, top_p, top_k, min_p, stop_ids, seed_data,
                                     seeded)]
    lengths, active_d, budget_d = (jnp.asarray(self._lengths), jnp.asarray(active),
                                   jnp.asarray(budget))
    host_lengths, host_budget = self._lengths.copy(), budget.copy()
    while bool(np.any(active)):
      # The block's rows end below their length + what they may still emit in it.
      reach = host_lengths + np.minimum(host_budget, self.config.decode_block)
      span = self.config.span_for(int(reach[active].max()))
      (self._cache, self._last_logits, lengths, active_d, budget_d, tok, logp, n_out,
       self._key) = self._decode(span, self._params, self._cache, self._last_logits, lengths,
                                 active_d, budget_d, *args, self._key)
      tok, logp, n_out, active = jax.device_get((tok, logp, n_out, active_d))
      host_lengths += n_out
      host_budget -= n_out
      for s, (toks, logps) in outputs.items():
        toks.extend(int(t) for t in tok[s, :n_out[s]])
        logps.extend(float(x) for x in logp[s, :n_out[s]])
    self._lengths = host_lengths  # the device's lengths, tracked on the host (no fetch)
    return outputs


def _check_token_mask(req: GenerateRequest, vocab_size: int, field: str) -> None:
  mask = req.token_mask
  if not (isinstance(mask, np.ndarray) and mask.dtype == bool and mask.shape == (vocab_size,)):
    raise ValueError(f"{field}.token_mask must be a bool array of shape ({vocab_size},)")
  if req.sampling.max_new_tokens != 1:
    raise ValueError(f"{field}.token_mask constrains one token: sampling.max_new_tokens must "
                     f"be 1, got {req.sampling.max_new_tokens}")
  if not mask.any():
    raise ValueError(f"{field}.token_mask allows no token")
