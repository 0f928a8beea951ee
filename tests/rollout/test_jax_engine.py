"""The in-process JAX engine: trainer-equal logprobs, greedy == full forwards, sessions, swaps."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bat_jax.grpo.logprobs import taken_token_logprobs
from bat_jax.rollout.engine import GenerateRequest, PromptTooLongError, SamplingParams
from bat_jax.rollout.jax_engine import JaxEngine
from bat_jax.rollout.sampling import sample_tokens
from rollout_fixtures import SMALL_ENGINE

CFG = SMALL_ENGINE
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12], list(range(40, 75))]


@pytest.fixture(scope="module")
def engine(model):
  return JaxEngine(model, CFG)


WIDTH = 96  # every reference forward is right padded to this width: one compilation


@nnx.jit(static_argnames="temperature")
def _trainer_logp(model, ids, temperature=1.0):
  return taken_token_logprobs(model, ids, valid=jnp.ones_like(ids, bool), chunk_size=32,
                              temperature=temperature)[0]


@nnx.jit
def _full_logits(model, ids):
  return model(ids)


def _padded(seqs: list[list[int]]) -> jnp.ndarray:
  out = np.zeros((len(seqs), WIDTH), np.int32)
  for i, s in enumerate(seqs):
    out[i, :len(s)] = s
  return jnp.asarray(out)


def trainer_logprobs(model, seq: list[int], temperature: float = 1.0) -> np.ndarray:
  """The GRPO trainer's quantity for one sequence: [T], column t scores seq[t] (logits / T).

  Right padding cannot change a causal LM's values at earlier positions.
  """
  return np.asarray(_trainer_logp(model, _padded([seq]), temperature)[0, :len(seq)])


def greedy_by_full_forward(model, prompts: list[list[int]], n: int) -> list[list[int]]:
  """Argmax of repeated full (cache-free) forwards, all prompts batched."""
  seqs = [list(p) for p in prompts]
  for _ in range(n):
    logits = _full_logits(model, _padded(seqs))
    for i, s in enumerate(seqs):
      s.append(int(jnp.argmax(logits[i, len(s) - 1])))
  return [s[len(p):] for s, p in zip(seqs, prompts)]


def test_sampled_logprobs_equal_trainer_logprobs_at_the_sampling_temperature(engine, model):
  """The logprob contract: log softmax(logits / T) of the sampled distribution, T = 0.7 here
  (top-p truncation does not enter it); greedy is scored at T = 1, like SGLang."""
  requests = [GenerateRequest(p, SamplingParams(max_new_tokens=12, temperature=t, top_p=tp))
              for p, t, tp in zip(PROMPTS, (0.7, 0.7, 0.0), (1.0, 0.8, 1.0))]
  for req, c in zip(requests, engine.generate(requests)):
    assert len(c.output_ids) == 12 and c.finish_reason == "length"
    seq = list(req.input_ids) + list(c.output_ids)
    t = req.sampling.temperature or 1.0
    expected = trainer_logprobs(model, seq, t)[len(req.input_ids):]
    np.testing.assert_allclose(c.logprobs, expected, atol=1e-4, rtol=0)
    if t != 1.0:  # and it is not the temperature-1 quantity (the old, wrong contract)
      assert np.max(np.abs(np.array(c.logprobs) - trainer_logprobs(model, seq)[
          len(req.input_ids):])) > 1e-2


def test_greedy_cached_generation_equals_full_forward_argmax(engine, model):
  completions = engine.generate(
      [GenerateRequest(p, SamplingParams(max_new_tokens=10, temperature=0.0)) for p in PROMPTS])
  assert [list(c.output_ids) for c in completions] == greedy_by_full_forward(model, PROMPTS, 10)
  assert len(set(completions[0].output_ids)) > 3  # the fixture model is not degenerate


def test_session_continuation_reuses_prefix_and_matches_fresh_prefill(model):
  engine = JaxEngine(model, CFG)
  greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
  first = engine.generate([GenerateRequest(PROMPTS[0], greedy, session_id="a")])[0]
  history = PROMPTS[0] + list(first.output_ids) + [11, 12, 13]   # an observation delta
  second = engine.generate([GenerateRequest(history, greedy, session_id="a")])[0]
  assert second.cached_tokens == len(PROMPTS[0]) + len(first.output_ids)
  engine.flush()
  fresh = engine.generate([GenerateRequest(history, greedy, session_id="a")])[0]
  assert fresh.cached_tokens == 0
  assert second.output_ids == fresh.output_ids
  np.testing.assert_allclose(second.logprobs, fresh.logprobs, atol=1e-5)
  np.testing.assert_allclose(
      second.logprobs, trainer_logprobs(model, history + list(second.output_ids))[len(history):],
      atol=1e-4)


def test_more_requests_than_slots_and_stop_tokens(engine, model):
  greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
  prompts = [[i + 1, 2 * i + 3, 7] for i in range(CFG.num_slots + 3)]
  out = engine.generate([GenerateRequest(p, greedy) for p in prompts])
  assert [list(c.output_ids) for c in out] == greedy_by_full_forward(model, prompts, 8)
  # Stop on the third greedy token: the output keeps it and ends there.
  stop = out[0].output_ids[2]
  first = out[0].output_ids.index(stop)
  c = engine.generate([GenerateRequest(prompts[0], SamplingParams(
      max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,)))])[0]
  assert c.output_ids == out[0].output_ids[:first + 1] and c.finish_reason == "stop"


def flipped(model):
  """A same-shaped model with different weights (every matrix negated)."""
  other = nnx.clone(model)
  params = nnx.state(other, nnx.Param)
  nnx.update(other, jax.tree.map(lambda x: -x if x.ndim >= 2 else x, params))
  return other


def test_update_params_swaps_in_place_and_validates(model):
  engine = JaxEngine(model, CFG, weight_version="v0")
  greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
  before = engine.generate([GenerateRequest(PROMPTS[0], greedy, session_id="s")])[0]
  other = flipped(model)
  engine.update_params(other, "v1")
  after = engine.generate([GenerateRequest(PROMPTS[0], greedy, session_id="s")])[0]
  assert after.weight_version == "v1" and after.cached_tokens == 0  # cache dropped
  assert after.output_ids != before.output_ids
  assert list(after.output_ids) == greedy_by_full_forward(other, PROMPTS[:1], 8)[0]
  wrong = nnx.state(nnx.clone(model))
  wrong["norm"]["weight"].value = jnp.zeros((3,))
  with pytest.raises(ValueError, match=r"\['norm'\]\['weight'\].*does not match the served"):
    engine.update_params(wrong, "bad")
  assert engine.weight_version == "v1"


def test_bad_prompts_are_refused_with_the_field_named(engine, tokenizer):
  with pytest.raises(PromptTooLongError, match=r"The input \(96 tokens\) is longer than the "
                     r"model's context length \(96 tokens\): requests\[0\].input_ids has 96"):
    engine.generate([GenerateRequest([1] * CFG.max_len)])
  with pytest.raises(ValueError, match="outside"):
    engine.generate([GenerateRequest([len(tokenizer) + 5])])
  with pytest.raises(ValueError, match="is empty"):
    engine.generate([GenerateRequest([])])
  with pytest.raises(ValueError, match="sampling_params.top_p"):
    SamplingParams(top_p=0.0)


def test_generation_budget_is_capped_by_max_len(engine):
  c = engine.generate([GenerateRequest([3] * (CFG.max_len - 4),
                                       SamplingParams(max_new_tokens=50, temperature=0.0))])[0]
  assert len(c.output_ids) == 4 and c.finish_reason == "length"


def test_sampler_respects_top_k_top_p_and_greedy():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4, jnp.float32))
  draws = jax.vmap(lambda k: sample_tokens(
      logits, k, temperature=jnp.array([1.0, 1.0, 0.0, 1.0]), top_p=jnp.array([1.0, 0.6, 1.0, 1.0]),
      top_k=jnp.array([2, -1, -1, -1])))(jax.random.split(jax.random.key(0), 400))
  draws = np.asarray(draws)                        # [400, 4]
  assert set(draws[:, 0]) == {0, 1}                 # top-k 2
  assert set(draws[:, 1]) == {0, 1}                 # top-p 0.6 keeps 0.5 + 0.3
  assert set(draws[:, 2]) == {0}                    # greedy
  assert set(draws[:, 3]) == {0, 1, 2, 3}           # untruncated
  assert abs((draws[:, 3] == 0).mean() - 0.5) < 0.1


def test_attention_reads_only_the_cache_span_its_rows_reach(model):
  """A 1,280-slot cache: each call's attention reads the first 512 / 768 / ... slots its rows
  reach (decode time grows with the slots read), and a generation that crosses a span
  boundary, then a session continued past the next one, still equal cache-free forwards."""
  cfg = dataclasses.replace(CFG, max_len=1280, prefill_chunk=128, decode_block=8)
  assert cfg.span_buckets == (512, 768, 1024, 1280) and cfg.span_for(513) == 768
  engine = JaxEngine(model, cfg)
  spans = []
  for name in ("_decode", "_prefill"):
    program = getattr(engine, name)
    setattr(engine, name, lambda span, *a, _p=program: spans.append(span) or _p(span, *a))
  rng = np.random.default_rng(3)
  prompts = [rng.integers(1, 200, 505).tolist(), [5, 17, 99]]
  greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
  out = engine.generate([GenerateRequest(p, greedy, session_id=str(i))
                         for i, p in enumerate(prompts)])
  width = 640
  seqs = [list(p) for p in prompts]
  for _ in range(12):
    logits = _full_logits(model, jnp.asarray([s + [0] * (width - len(s)) for s in seqs]))
    for i, seq in enumerate(seqs):
      seq.append(int(jnp.argmax(logits[i, len(seq) - 1])))
  assert [list(c.output_ids) for c in out] == [s[len(p):] for s, p in zip(seqs, prompts)]
  assert 512 in spans and 768 in spans and max(spans) == 768  # never the whole cache
  history = seqs[0] + rng.integers(1, 200, 250).tolist()   # 767 tokens: past 768 while decoding
  more = engine.generate([GenerateRequest(history, greedy, session_id="0")])[0]
  assert more.cached_tokens == len(seqs[0]) and 1024 in spans and 1280 not in spans
  padded = jnp.asarray([history + list(more.output_ids) + [0] * 100])
  want = np.asarray(_trainer_logp(model, padded)[0])[len(history):len(history) + 12]
  np.testing.assert_allclose(more.logprobs, want, atol=1e-4)


def test_a_greedy_completion_does_not_depend_on_its_batchmates(model):
  """Bitwise: the same greedy request alone, or beside requests whose prompts take other
  prefill chunks and reach further into the cache (a wider attention span: 640 slots, not
  512), gives the same tokens and logprobs: reading more (masked) cache slots changes no
  rounding, so the span a call picks for its longest row cannot flip a greedy token."""
  cfg = dataclasses.replace(CFG, max_len=640, prefill_chunk=128, decode_block=8)
  rng = np.random.default_rng(5)
  target = rng.integers(1, 200, 150).tolist()                     # chunks 128 + 32
  others = [rng.integers(1, 200, 600).tolist(), [7, 8, 9]]        # 128 x 5, span 640; 32
  greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
  alone = JaxEngine(model, cfg).generate([GenerateRequest(target, greedy)])[0]
  batched = JaxEngine(model, cfg).generate(
      [GenerateRequest(p, greedy) for p in (others[0], target, others[1])])[1]
  assert batched.output_ids == alone.output_ids
  assert batched.logprobs == alone.logprobs


def test_decode_and_prefill_compile_once_per_shape(engine):
  traced = []  # every trace or XLA compile in this process, from JAX's public monitoring hook
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _, **kw: traced.append(event) if event.startswith("/jax/core/compile/")
      else None)
  sampling = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=3)
  engine.generate([GenerateRequest([1, 2, 3], sampling)])
  warm = len(traced)
  # Other prompt lengths, batch sizes, budgets and sampling settings reuse the same programs.
  engine.generate([GenerateRequest(list(range(1, 30)), SamplingParams(max_new_tokens=11)),
                   GenerateRequest([4, 5], SamplingParams(max_new_tokens=2, temperature=0.0)),
                   GenerateRequest([9] * 40, SamplingParams(max_new_tokens=17, top_p=0.5))])
  assert traced[warm:] == []


def test_a_fresh_engine_compiles_its_programs_once(model):
  """The engine's first arrays (cache, logits, key, a reseeded key) are committed like the
  programs' outputs; uncommitted ones keyed a second compilation of every program on the
  second call (~28 CPU s for the decode benchmark's model)."""
  graphdef, state = nnx.split(model)
  loaded = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))  # as load_pretrained
  engine = JaxEngine(loaded, dataclasses.replace(CFG, seed=1234, prefill_chunk=32))  # own jits
  traced = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, _, **kw: traced.append(event) if event.startswith("/jax/core/compile/")
      else None)
  request = GenerateRequest([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=3))
  first = engine.generate([request])
  assert traced, "the first generate compiles the engine's programs"
  warm = len(traced)
  engine.flush()
  assert engine.generate([request])[0].output_ids != () and traced[warm:] == []
  engine.reseed(7)
  assert len(engine.generate([request])[0].output_ids) == len(first[0].output_ids)
  assert traced[warm:] == []
