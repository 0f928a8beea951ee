"""OpenAI-compatible `/v1/models` and `/v1/chat/completions` (plain and streamed) for serve."""

from __future__ import annotations

import dataclasses
import functools
import json
import queue
import re
import time
import uuid
from http import HTTPStatus
from typing import Any, Callable, Iterator, Optional

from bat_jax.rollout.openai_chat import assistant_turn, openai_to_messages, tool_call
from bat_jax.rollout.server import params as P
from bat_jax.rollout.server.params import RequestError, Sampling
from bat_jax.rollout.server.scheduler import Job
from bat_jax.rollout.server.grammar import response_format_grammar
from bat_jax.rollout.server.text import (CALL_OPEN, THINK_CLOSE, ReasoningSplit, StreamText,
                                         split_reasoning, token_bytes, trim_at_stop)

CHAT_FIELDS = frozenset({
    "model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop", "seed",
    "user", "parallel_tool_calls", "logprobs", "top_logprobs", "frequency_penalty",
    "presence_penalty", "logit_bias", "response_format", "chat_template_kwargs"})
_ONLY_DEFAULT = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128


class OpenAIChat:
  """The OpenAI endpoints over a ServeApp."""

  def __init__(self, app):
    self.app = app

  def models(self) -> dict:
    return {"object": "list", "data": [self._card()]}

  def _card(self) -> dict:
    served = self.app.served
    return {"id": served.name, "object": "model", "created": 0, "owned_by": "bat-jax",
            "root": served.model_path, "max_model_len": served.engine.config.max_len}

  def model(self, model_id: str) -> dict:
    """GET /v1/models/{id}."""
    self.check_model(model_id or None)
    return self._card()

  def check_model(self, model: Any) -> None:
    name = self.app.served.name
    if model not in (None, "default", name, self.app.served.model_path):
      raise RequestError(f"unknown model {P.brief(model)}; this server serves {name!r} "
                         "(GET /v1/models)", HTTPStatus.NOT_FOUND)

  def chat_completions(self, body: Any, client_gone: Callable[[], bool]) -> Any:
    body = P.obj(body, "request body")
    P.ignore_unknown(body, CHAT_FIELDS, "/v1/chat/completions", self.app.warned)
    fmt = self.app.served.chat_format
    if fmt is None:
      raise RequestError("this checkpoint has no tokenizer, so /v1/chat/completions is off")
    name = self.app.served.name
    self.check_model(body.get("model"))
    P.only_default(body, _ONLY_DEFAULT, "")
    fmt, template_kwargs = _template_kwargs(fmt, body.get("chat_template_kwargs"))
    grammar = response_format_grammar(body.get("response_format"))
    fmt_req, tools, parse_tools, forced = self._tools(body, fmt)
    if grammar is not None:
      if forced:
        raise RequestError("response_format cannot be combined with tool_choice 'required' "
                           "or a named function")
      forced = close_think(fmt)  # the JSON answer starts after an (empty) reasoning block
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
      raise RequestError("messages must be a non-empty list")
    max_len = self.app.served.engine.config.max_len
    if 3 * len(messages) >= max_len:  # each message renders to >= 3 tokens
      raise RequestError(f"messages has {len(messages)} messages; they cannot fit the "
                         f"{max_len}-token context")
    chars = sum(len(json.dumps(m)) for m in messages)
    if chars > 64 * max_len:  # checked before the (costly) chat template runs
      raise RequestError(f"messages has {chars} characters; they cannot fit the "
                         f"{max_len}-token context")
    try:
      prompt = fmt_req.encode_prompt(openai_to_messages(messages), tools, **template_kwargs)
    except RequestError:
      raise
    except Exception as e:  # pylint: disable=broad-except  # templates raise many kinds
      raise RequestError(f"messages could not be rendered: {type(e).__name__}: {e}"[:2000])
    prompt = prompt + fmt.encode(forced)
    self.app.served.engine.check_prompt(prompt, "messages")
    sampling = dataclasses.replace(self._sampling(body, fmt), grammar=grammar)
    P.check_max_tokens(sampling.max_new_tokens, len(prompt), max_len, "messages")
    stream = P.boolean(body.get("stream", False) or False, "stream")
    usage_chunk = False
    if body.get("stream_options") is not None:
      opts = P.obj(body["stream_options"], "stream_options")
      P.no_unknown(opts, {"include_usage", "continuous_usage_stats"}, "stream_options")
      usage_chunk = P.boolean(opts.get("include_usage", False), "stream_options.include_usage")
    jobs = self.app.jobs([prompt], sampling)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
    ctx = _Ctx(fmt_req, parse_tools, forced, body.get("logprobs") is True, head)
    ctx.thinks = _opens_think(fmt_req, forced)
    if stream:
      self.app.check_available()
      return self._stream(jobs, ctx, usage_chunk)
    self.app.run(jobs, client_gone)
    return self._answer(jobs, ctx)

  # -- request parts ----------------------------------------------------------------------------

  def _tools(self, body: dict, fmt) -> tuple[Any, list, bool, str]:
    """(ChatFormat for the request's tools, tools to render, parse tool calls?, forced text)."""
    tools = body.get("tools")
    tools = [] if tools is None else tools
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
      raise RequestError(f"tools must be a list of at most {MAX_TOOLS} tools")
    for i, tool in enumerate(tools):
      _check_tool(tool, f"tools[{i}]")
    choice = body.get("tool_choice")
    choice = ("auto" if tools else "none") if choice is None else choice
    if body.get("parallel_tool_calls") is not None:
      P.boolean(body["parallel_tool_calls"], "parallel_tool_calls")
    if choice == "none":
      return fmt, [], False, ""
    if not tools:
      raise RequestError(f"tool_choice = {P.brief(choice)} needs tools")
    if choice == "auto":
      return _format_for(fmt, json.dumps(tools, sort_keys=True)), tools, True, ""
    if choice == "required":  # the turn is forced to open a tool call
      fmt_all = _format_for(fmt, json.dumps(tools, sort_keys=True))
      return fmt_all, tools, True, forced_call_prefix(fmt_all, None)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(fn, dict) and isinstance(fn.get("name"), str)):
      raise RequestError(f"tool_choice must be 'auto', 'none', 'required' or {{'type': "
                         f"'function', "
                         f"'function': {{'name': ...}}}}, got {P.brief(choice)}")
    named = [t for t in tools if t["function"]["name"] == fn["name"]]
    if not named:
      raise RequestError(f"tool_choice names {fn['name']!r}, which is not in tools")
    fmt_one = _format_for(fmt, json.dumps(named, sort_keys=True))
    return fmt_one, named, True, forced_call_prefix(fmt_one, fn["name"])

  def _sampling(self, body: dict, fmt) -> Sampling:
    g = lambda k, default: default if body.get(k) is None else body[k]  # noqa: E731
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    top_n = 0
    if g("logprobs", False):
      P.boolean(body["logprobs"], "logprobs")
      top_n = P.integer(g("top_logprobs", 0), "top_logprobs", lo=0, hi=P.MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs"):
      raise RequestError("top_logprobs needs logprobs = true")
    seed = None if body.get("seed") is None else P.integer(
        body["seed"], "seed", lo=P.SEED_RANGE[0], hi=P.SEED_RANGE[1])
    if body.get("user") is not None and not isinstance(body["user"], str):
      raise RequestError("user must be a string")
    top_k = P.integer(g("top_k", -1), "top_k", lo=-1, hi=1 << 30)
    if top_k == 0:
      raise RequestError("top_k = 0 is invalid: expected -1 (off) or >= 1")
    temperature = P.number(g("temperature", 1.0), "temperature", lo=0.0, hi=100.0)
    sampling = Sampling(
        temperature=0.0 if temperature < P.GREEDY_EPS else temperature,
        top_p=P.number(g("top_p", 1.0), "top_p", lo=0.0, hi=1.0, lo_open=True), top_k=top_k,
        min_p=P.number(g("min_p", 0.0), "min_p", lo=0.0, hi=1.0),
        max_new_tokens=None if max_tokens is None else P.integer(
            max_tokens, "max_completion_tokens" if "max_completion_tokens" in body
            else "max_tokens", lo=1, hi=1 << 30),
        stop=P.stop_strings(body.get("stop"), "stop"), stop_token_ids=fmt.stop_token_ids,
        n=P.integer(g("n", 1), "n", lo=1, hi=P.MAX_N), top_logprobs=top_n, seed=seed)
    P.check_stop_ids(sampling, self.app.max_stop_ids, "stop")
    return sampling

  # -- answers ----------------------------------------------------------------------------------

  def _choice_message(self, job: Job, ctx: "_Ctx") -> tuple[dict, str]:
    tok = ctx.fmt.tokenizer
    forced = ctx.forced if CALL_OPEN in ctx.forced else ""  # a closed empty reasoning: not text
    special = forced + trim_at_stop(ctx.fmt.decode(job.out_ids), job.finish)
    plain = forced + trim_at_stop(tok.decode(job.out_ids, skip_special_tokens=True),
                                  job.finish)
    message, finish = assistant_turn(special, plain, ctx.fmt, parse_tools=ctx.parse_tools,
                                     cut_at_length=job.finish["type"] == "length")
    reasoning, content = split_reasoning(plain, ctx.thinks)
    if reasoning is not None:  # the turn thought: its reasoning is not content
      if "tool_calls" in message:
        content = content.split(CALL_OPEN, 1)[0].strip() or None
      message["content"], message["reasoning_content"] = content, reasoning
    return message, finish

  def _answer(self, jobs: list[Job], ctx: "_Ctx") -> dict:
    choices = []
    for job in jobs:
      message, finish = self._choice_message(job, ctx)
      choices.append({"index": job.index, "message": message, "finish_reason": finish,
                      "logprobs": self._logprobs(job, 0, ctx) if ctx.logprobs else None})
    return {**ctx.head, "object": "chat.completion", "choices": choices,
            "usage": _usage(jobs), "system_fingerprint": jobs[0].weight_version}

  def _logprobs(self, job: Job, start: int, ctx: "_Ctx", end: Optional[int] = None) -> dict:
    tok = ctx.fmt.tokenizer
    entry = lambda t, lp: {"token": tok.decode([t]), "logprob": lp,  # noqa: E731
                           "bytes": list(token_bytes(tok, t))}
    content = []
    for i in range(start, len(job.out_ids) if end is None else end):
      item = entry(job.out_ids[i], job.logprobs[i])
      item["top_logprobs"] = ([entry(t, lp) for t, lp in job.top_logprobs[i]]
                              if job.top_logprobs else [])
      content.append(item)
    return {"content": content, "refusal": None}

  def _stream(self, jobs: list[Job], ctx: "_Ctx", usage_chunk: bool) -> Iterator[dict]:
    """Chunks of `chat.completion.chunk`; closing the iterator cancels the jobs."""
    sink: queue.Queue = queue.Queue()
    for job in jobs:
      job.sink = sink
    tok = ctx.fmt.tokenizer
    # A forced call (named tool_choice) is all call: nothing of it streams as content.
    texts = [StreamText(tok, stops=j.sampling.stop, hold_tool_calls=ctx.parse_tools,
                        hold_all=CALL_OPEN in ctx.forced) for j in jobs]
    for t in texts:
      t.split = ReasoningSplit(ctx.thinks)
    chunk = lambda choices, **kw: {**ctx.head, "object": "chat.completion.chunk",  # noqa: E731
                                   "system_fingerprint": jobs[0].weight_version or None,
                                   "choices": choices, **kw}
    delta = lambda i, d, finish=None, lp=None: {"index": i, "delta": d,  # noqa: E731
                                                "logprobs": lp, "finish_reason": finish}
    self.app.scheduler.submit(jobs)
    try:
      yield chunk([delta(j.index, {"role": "assistant", "content": ""})
                   for j in jobs])
      live, seen = len(jobs), [0] * len(jobs)
      while live:
        try:
          i, new_ids, _ = sink.get(timeout=1.0)
        except queue.Empty:
          continue
        job = jobs[i]
        if new_ids is not None:
          text = texts[i].feed(new_ids)
          end = len(texts[i].ids)
          lp = None
          if ctx.logprobs and job.top_logprobs is None and not job.sampling.top_logprobs:
            lp = self._logprobs(job, seen[i], ctx, end)
            seen[i] = end
          d = _text_delta(texts[i], text)
          if d or lp or texts[i].split.pending:  # held reasoning: still a chunk, so a client
            yield chunk([delta(i, d or {"content": ""}, lp=lp)])  # that left is noticed
          continue
        live -= 1
        yield from self._stream_end(job, texts[i], ctx, chunk, delta, seen[i])
      if usage_chunk:
        yield chunk([], usage=_usage(jobs))
    finally:
      for job in jobs:
        job.cancel()

  def _stream_end(self, job: Job, text: StreamText, ctx: "_Ctx", chunk, delta, seen: int):
    if job.error is not None:
      yield {"error": {"message": f"{type(job.error).__name__}: {job.error}"[:2000]}}
      return
    message, finish = self._choice_message(job, ctx)
    lp = self._logprobs(job, seen, ctx) if ctx.logprobs and seen < len(job.out_ids) else None
    if "tool_calls" in message:
      d = _text_delta(text, text.finish(job.finish, upto_call=True), final=True)
      if d or lp:
        yield chunk([delta(job.index, d or {"content": ""}, lp=lp)])
      for k, call in enumerate(message["tool_calls"]):
        yield chunk([delta(job.index, {"tool_calls": [{
            "index": k, "id": call["id"], "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""}}]})])
        yield chunk([delta(job.index, {"tool_calls": [{
            "index": k, "function": {"arguments": call["function"]["arguments"]}}]})])
    else:
      d = _text_delta(text, text.finish(job.finish), final=True)
      if d or lp:
        yield chunk([delta(job.index, d or {"content": ""}, lp=lp)])
    yield chunk([delta(job.index, {}, finish=finish)])


class _Ctx:
  """What answering one chat request needs besides its jobs."""

  def __init__(self, fmt, parse_tools: bool, forced: str, logprobs: bool, head: dict):
    self.fmt, self.parse_tools, self.forced = fmt, parse_tools, forced
    self.logprobs, self.head = logprobs, head
    self.thinks = False   # the generated turn starts inside a <think> block


def _text_delta(stream: StreamText, text: str, final: bool = False) -> dict:
  """A stream delta of released text: its reasoning and content parts (empty: nothing)."""
  reasoning, content = stream.split.feed(text, final=final)
  return {**({"reasoning_content": reasoning} if reasoning else {}),
          **({"content": content} if content else {})}


def _opens_think(fmt, forced: str) -> bool:
  """The generation prompt (plus forced text) leaves the turn inside an open <think> block."""
  return fmt.enable_thinking and fmt.family == "qwen3_5" and THINK_CLOSE not in forced


def close_think(fmt) -> str:
  """Text that closes the reasoning block a thinking Qwen3.5 prompt opened (else nothing)."""
  return "\n</think>\n\n" if fmt.enable_thinking and fmt.family == "qwen3_5" else ""


@functools.lru_cache(maxsize=8)
def _thinking_format(fmt, enable_thinking: bool):
  return type(fmt)(fmt.family, fmt.tokenizer, tools=fmt.tools, enable_thinking=enable_thinking,
                   max_turn_chars=fmt.max_turn_chars)


def _template_kwargs(fmt, value: Any) -> tuple[Any, dict]:
  """`chat_template_kwargs`: enable_thinking picks the format; the rest go to the template."""
  if value is None:
    return fmt, {}
  kwargs = dict(P.obj(value, "chat_template_kwargs"))
  for key in ("tools", "messages", "add_generation_prompt", "chat_template", "tokenize"):
    if key in kwargs:
      raise RequestError(f"chat_template_kwargs.{key} cannot be set (the server sets it)")
  if "enable_thinking" in kwargs:
    thinking = P.boolean(kwargs.pop("enable_thinking"), "chat_template_kwargs.enable_thinking")
    if thinking != fmt.enable_thinking:
      fmt = _thinking_format(fmt, thinking)
  return fmt, kwargs


def _usage(jobs: list[Job]) -> dict:
  completion = sum(len(j.out_ids) for j in jobs)
  prompt = len(jobs[0].prompt)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


def _check_tool(tool: Any, field: str) -> None:
  """An OpenAI function tool whose schema the parser can check arguments against."""
  if not isinstance(tool, dict) or tool.get("type") != "function":
    raise RequestError(f"{field} must be {{'type': 'function', 'function': {{...}}}}, got "
                       f"{P.brief(tool)}")
  P.no_unknown(tool, {"type", "function"}, field)
  fn = P.obj(tool.get("function"), f"{field}.function")
  P.no_unknown(fn, {"name", "description", "parameters", "strict"}, f"{field}.function")
  if not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(fn["name"]):
    raise RequestError(f"{field}.function.name must match {_TOOL_NAME.pattern}, got "
                       f"{P.brief(fn.get('name'))}")
  if fn.get("description") is not None and not isinstance(fn["description"], str):
    raise RequestError(f"{field}.function.description must be a string")
  params = P.obj(fn.get("parameters", {"type": "object"}), f"{field}.function.parameters")
  P.shallow_schema(params, f"{field}.function.parameters")  # before any recursive rendering
  if params.get("type", "object") != "object":
    raise RequestError(f"{field}.function.parameters.type must be 'object'")
  props = P.obj(params.get("properties", {}), f"{field}.function.parameters.properties")
  for key, spec in props.items():
    P.obj(spec, f"{field}.function.parameters.properties.{key}")
  required = params.get("required", [])
  if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
    raise RequestError(f"{field}.function.parameters.required must be a list of strings")


@functools.lru_cache(maxsize=32)
def _format_cache(fmt, tools_json: str):
  return type(fmt)(fmt.family, fmt.tokenizer, tools=json.loads(tools_json),
                   enable_thinking=fmt.enable_thinking, max_turn_chars=fmt.max_turn_chars)


def _format_for(fmt, tools_json: str):
  """The served ChatFormat with the request's tools (what the parser validates against)."""
  return _format_cache(fmt, tools_json)


def forced_call_prefix(fmt, name: Optional[str]) -> str:
  """Text that opens a call of `name` (None: of some tool, tool_choice 'required') right after
  the generation prompt (tool_choice named)."""
  if fmt.family == "qwen3":
    return f'{CALL_OPEN}\n{{"name": ' + (f'{json.dumps(name)}, "arguments": ' if name else "")
  return f"{close_think(fmt)}{CALL_OPEN}\n" + (f"<function={name}>\n" if name else "")


__all__ = ["OpenAIChat", "tool_call"]
