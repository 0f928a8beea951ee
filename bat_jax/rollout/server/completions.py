"""OpenAI's legacy `/v1/completions` for serve: text or token prompts, echo, logprobs, and
prompt logprobs (what lm-evaluation-harness's `local-completions` loglikelihood tasks read).

`echo` with `logprobs` scores the prompt tokens with one forward pass (temperature 1, the first
token's logprob is null, as in OpenAI and vLLM); `max_tokens = 0` with `echo` only scores.
Generated tokens carry the engine's sampled logprobs and, with `logprobs = k`, their k most
likely alternatives (re-scored, see `text.top_logprobs`). Each `top_logprobs` entry holds the
chosen token too, as vLLM's.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Optional

from bat_jax.rollout.server import params as P
from bat_jax.rollout.server.params import RequestError, Sampling
from bat_jax.rollout.server.scheduler import Job
from bat_jax.rollout.server.text import prompt_logprobs, trim_at_stop

FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                    "n", "stop", "seed", "logprobs", "echo", "user", "stream",
                    "frequency_penalty", "presence_penalty", "logit_bias", "best_of", "suffix"})
_ONLY_DEFAULT = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None,
                 "best_of": 1, "suffix": None, "stream": False}
DEFAULT_MAX_TOKENS = 16   # OpenAI's default for completions


class Completions:
  """`POST /v1/completions` over a ServeApp."""

  def __init__(self, app):
    self.app = app

  def create(self, body: Any, client_gone: Callable[[], bool]) -> dict:
    app = self.app
    body = P.obj(body, "request body")
    P.ignore_unknown(body, FIELDS, "/v1/completions", app.warned)
    app.openai.check_model(body.get("model"))
    P.only_default(body, _ONLY_DEFAULT, "")
    prompts = self._prompts(body.get("prompt"))
    echo = P.boolean(body.get("echo", False) or False, "echo")
    k = None if body.get("logprobs") is None else P.integer(
        body["logprobs"], "logprobs", lo=0, hi=P.MAX_TOP_LOGPROBS)
    max_tokens = P.integer(DEFAULT_MAX_TOKENS if body.get("max_tokens") is None
                           else body["max_tokens"], "max_tokens", lo=0, hi=1 << 30)
    if max_tokens == 0 and not echo:
      raise RequestError("max_tokens = 0 needs echo = true (it only scores the prompt)")
    max_len = app.served.engine.config.max_len
    for i, ids in enumerate(prompts):
      app.served.engine.check_prompt(ids, f"prompt[{i}]" if len(prompts) > 1 else "prompt")
      P.check_max_tokens(max_tokens, len(ids), max_len, "prompt")
    sampling = self._sampling(body, max_tokens, k or 0)
    if len(prompts) * sampling.n > P.MAX_BATCH:
      raise RequestError(f"{len(prompts)} prompts x n = {sampling.n} exceeds {P.MAX_BATCH}")
    jobs = [] if max_tokens == 0 else app.jobs(prompts, sampling)
    if jobs:
      app.run(jobs, client_gone)
    choices = []
    for p, ids in enumerate(prompts):
      scored = (prompt_logprobs(app.served.graphdef, app.served.engine.params, ids, k)
                if echo and k is not None else None)
      for j in range(sampling.n):
        job = jobs[p * sampling.n + j] if jobs else None
        choices.append(self._choice(len(choices), ids, job, echo, k, scored))
    completion = sum(len(j.out_ids) for j in jobs)
    prompt_tokens = sum(len(ids) for ids in prompts)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": app.served.name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion},
            "system_fingerprint": app.served.engine.weight_version}

  def _prompts(self, prompt: Any) -> list[list[int]]:
    """A string, a list of strings, a list of token ids or a list of such lists."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
      prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or len(prompt) > P.MAX_BATCH:
      raise RequestError(f"prompt must be a string, a list of 1..{P.MAX_BATCH} strings, or "
                         "token ids (a list of integers, or a list of such lists)")
    out = []
    for i, p in enumerate(prompt):
      if isinstance(p, str):
        if len(p) > 64 * self.app.served.engine.config.max_len:
          raise RequestError(f"prompt[{i}] has {len(p)} characters; it cannot fit the context")
        out.append(self.app.need_tokenizer("prompt text").encode(p, add_special_tokens=False))
      elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in p):
        out.append(list(p))
      else:
        raise RequestError(f"prompt[{i}] must be a string or a list of token ids, got "
                           f"{P.brief(p)}")
    return out

  def _sampling(self, body: dict, max_tokens: int, k: int) -> Sampling:
    g = lambda key, default: default if body.get(key) is None else body[key]  # noqa: E731
    temperature = P.number(g("temperature", 1.0), "temperature", lo=0.0, hi=100.0)
    top_k = P.integer(g("top_k", -1), "top_k", lo=-1, hi=1 << 30)
    if top_k == 0:
      raise RequestError("top_k = 0 is invalid: expected -1 (off) or >= 1")
    seed = None if body.get("seed") is None else P.integer(
        body["seed"], "seed", lo=P.SEED_RANGE[0], hi=P.SEED_RANGE[1])
    stop = P.stop_strings(body.get("stop"), "stop")
    if stop:
      self.app.need_tokenizer("stop")
    sampling = Sampling(
        temperature=0.0 if temperature < P.GREEDY_EPS else temperature,
        top_p=P.number(g("top_p", 1.0), "top_p", lo=0.0, hi=1.0, lo_open=True), top_k=top_k,
        min_p=P.number(g("min_p", 0.0), "min_p", lo=0.0, hi=1.0),
        max_new_tokens=max(max_tokens, 1), stop=stop, eos_token_ids=self.app.eos_token_ids(),
        n=P.integer(g("n", 1), "n", lo=1, hi=P.MAX_N), top_logprobs=k, seed=seed)
    P.check_stop_ids(sampling, self.app.max_stop_ids, "stop")
    return sampling

  def _choice(self, index: int, prompt: list[int], job: Optional[Job], echo: bool,
              k: Optional[int], scored: Optional[list]) -> dict:
    tok = self.app.served.tokenizer
    decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok else (  # noqa: E731
        lambda ids: "")
    out = [] if job is None else list(job.out_ids)
    text = trim_at_stop(decode(out), job.finish if job else None)
    if echo:
      text = decode(prompt) + text
    finish = "length" if job is None or job.finish["type"] == "length" else "stop"
    logprobs = None
    if k is not None:
      rows = (scored or []) if echo else []
      for i in range(len(out)):
        top = job.top_logprobs[i] if job.top_logprobs else []
        rows.append((job.logprobs[i], top))
      logprobs = self._logprobs((prompt if echo else []) + out, rows, tok)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

  @staticmethod
  def _logprobs(ids: list[int], rows: list, tok) -> dict:
    word = (lambda t: tok.decode([t])) if tok is not None else str  # noqa: E731
    tokens = [word(t) for t in ids]
    offsets, at = [], 0
    for w in tokens:
      offsets.append(at)
      at += len(w)
    top = [None if r is None else {**{word(t): lp for t, lp in r[1]}, tokens[i]: r[0]}
           for i, r in enumerate(rows)]
    return {"tokens": tokens, "token_logprobs": [None if r is None else r[0] for r in rows],
            "top_logprobs": top, "text_offset": offsets}
