"""Seeded sampling: OpenAI `seed` / SGLang `sampling_seed` make a request reproducible.

The token at absolute position p of a seeded request is drawn with fold_in(key(seed), p), so
the same request and seed give the same tokens and logprobs alone, next to other requests, in
another slot, and across step / decode-block boundaries.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import openai
import pytest

from bat_jax.rollout.engine import GenerateRequest, SamplingParams
from bat_jax.rollout.jax_engine import JaxEngine
from bat_jax.rollout.sampling import seed_key_data
from bat_jax.rollout.server.params import choice_seed
from serve_fixtures import ENGINE

USER = [{"role": "user", "content": "List the data."}]
OTHERS = [  # unseeded neighbours; the long one makes the prefill use a bigger chunk
    [{"role": "user", "content": "Describe the setup in detail. " * 12}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}],
]


@pytest.fixture(scope="module")
def client(served):
  return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0,
                       timeout=120)


def _ask(client, seed, n=1, messages=USER, max_tokens=12):
  out = client.chat.completions.create(model="bat-tiny", messages=messages, temperature=1.0,
                                       max_tokens=max_tokens, n=n, seed=seed, logprobs=True)
  return [(c.message.content, [t.token for t in c.logprobs.content],
           np.array([t.logprob for t in c.logprobs.content])) for c in out.choices]


def _same(a, b):
  assert a[0] == b[0] and a[1] == b[1]
  np.testing.assert_allclose(a[2], b[2], rtol=0, atol=1e-5)


def test_seeded_request_is_the_same_alone_and_among_concurrent_requests(client):
  [alone] = _ask(client, seed=1234)
  assert len(alone[1]) >= 4
  with ThreadPoolExecutor(4) as pool:
    others = [pool.submit(_ask, client, None, 1, m, 20) for m in OTHERS]
    [crowded] = pool.submit(_ask, client, 1234).result()
    [f.result() for f in others]
  _same(alone, crowded)
  [again] = _ask(client, seed=1234)   # the engine key moved on meanwhile; the seed did not
  _same(alone, again)


def test_different_seeds_give_different_samples(client):
  [a], [b] = _ask(client, seed=1), _ask(client, seed=2)
  assert a[1] != b[1]


def test_n_2_with_a_seed_gives_two_different_choices_reproducibly(client):
  first, second = _ask(client, seed=99, n=2)
  assert first[1] != second[1]
  again = _ask(client, seed=99, n=2)
  _same(first, again[0])
  _same(second, again[1])
  [single] = _ask(client, seed=99)    # choice 0 keeps the request's seed
  _same(first, single)


def test_sglang_sampling_seed_is_honoured(served):
  base = served[1]
  body = lambda seed: {"input_ids": [5, 6, 7, 8], "return_logprob": True,  # noqa: E731
                       "sampling_params": {"temperature": 1.0, "max_new_tokens": 10,
                                           "ignore_eos": True, "sampling_seed": seed}}
  a, b, c = (httpx.post(f"{base}/generate", json=body(s), timeout=120).json()
             for s in (42, 42, 43))
  assert a["output_ids"] == b["output_ids"] != c["output_ids"]
  bad = httpx.post(f"{base}/generate", json=body("x"), timeout=120)
  assert bad.status_code == 400 and "sampling_params.sampling_seed" in bad.text
  too_big = httpx.post(f"{base}/generate", json=body(1 << 64), timeout=120)
  assert too_big.status_code == 400 and "sampling_params.sampling_seed" in too_big.text


def test_engine_seed_is_independent_of_slot_batch_and_step_boundaries(model):
  """12 tokens in one call == 3 continued calls of 4 tokens each next to other requests."""
  engine = JaxEngine(model, ENGINE)
  prompt = [3, 1, 4, 1, 5, 9, 2, 6]
  seeded = lambda n: SamplingParams(max_new_tokens=n, temperature=1.0, seed=-7)  # noqa: E731
  [whole] = engine.generate([GenerateRequest(prompt, seeded(12))])
  engine.flush()
  ids, logps = list(prompt), []
  for step in range(3):
    noise = [GenerateRequest([11 + step] * (40 * step + 3), SamplingParams(max_new_tokens=6))
             for _ in range(step + 1)]
    out = engine.generate(noise + [GenerateRequest(ids, seeded(4))])[-1]
    ids += out.output_ids
    logps += out.logprobs
  assert tuple(ids[len(prompt):]) == whole.output_ids
  np.testing.assert_allclose(logps, whole.logprobs, rtol=0, atol=1e-5)
  engine.flush()
  [other] = engine.generate([GenerateRequest(prompt, SamplingParams(
      max_new_tokens=12, temperature=1.0, seed=-6))])
  assert other.output_ids != whole.output_ids


def test_seed_helpers():
  for seed in (0, 1, 12345, (1 << 31) - 1):
    np.testing.assert_array_equal(seed_key_data(seed),
                                  jax.random.key_data(jax.random.key(seed)))
  assert not np.array_equal(seed_key_data(-1), seed_key_data(1))
  assert choice_seed(None, 3) is None and choice_seed(5, 0) == 5
  seeds = {choice_seed(5, i) for i in range(8)} | {choice_seed(6, i) for i in range(8)}
  assert len(seeds) == 16 and all(0 <= s < 1 << 64 for s in seeds)
  with pytest.raises(ValueError, match="seed"):
    SamplingParams(seed=1 << 64)
  assert SamplingParams(seed=-3).to_dict()["sampling_seed"] == -3
