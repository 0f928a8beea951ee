"""OpenAI chat-completions <-> model-neutral messages, for `bat_jax.serve`.

OpenAI clients send assistant tool calls with `function.arguments` as a JSON *string*; the
chat templates want a mapping. The answer carries the parsed tool calls the same way OpenAI
does (`message.tool_calls[i].function.arguments` is a JSON string).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Mapping, Sequence

from bat_jax.rollout.engine import Completion


def openai_to_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
  """Validates OpenAI messages and converts tool-call arguments to mappings."""
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping):
      raise ValueError(f"messages[{i}] must be an object")
    role = m.get("role")
    if role not in ("system", "user", "assistant", "tool"):
      raise ValueError(f"messages[{i}].role = {role!r} is not system|user|assistant|tool")
    msg: dict[str, Any] = {"role": role, "content": _content_text(m.get("content"), i)}
    if role == "assistant":
      if m.get("reasoning_content"):
        msg["reasoning_content"] = str(m["reasoning_content"])
      calls = []
      for j, call in enumerate(m.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
          raise ValueError(f"messages[{i}].tool_calls[{j}].function.name is missing")
        args = fn.get("arguments", {})
        if isinstance(args, str):
          try:
            args = json.loads(args) if args.strip() else {}
          except json.JSONDecodeError as e:
            raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid "
                             f"JSON: {e}") from e
        if not isinstance(args, Mapping):
          raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be an object")
        calls.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
      if calls:
        msg["tool_calls"] = calls
    out.append(msg)
  return out


def _content_text(content: Any, i: int) -> str:
  """A message content: a string, or OpenAI content parts of type text."""
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    parts = []
    for j, part in enumerate(content):
      if not isinstance(part, Mapping) or part.get("type") != "text":
        raise ValueError(f"messages[{i}].content[{j}] must be a text part")
      parts.append(str(part.get("text", "")))
    return "".join(parts)
  raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


def chat_answer(completion: Completion, tokenizer: Any, chat_format: Any, *,
                model_name: str) -> dict[str, Any]:
  """The OpenAI `chat.completion` object for one completion."""
  text = chat_format.decode(completion.output_ids)
  parsed = chat_format.parse_actions(text)
  message: dict[str, Any] = {"role": "assistant"}
  finish = "length" if completion.finish_reason == "length" else "stop"
  if parsed.error is None and parsed.actions:
    message["content"] = parsed.thought or None
    message["tool_calls"] = [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": a["name"], "arguments": json.dumps(a["arguments"],
                                                                 ensure_ascii=False)}}
        for a in parsed.actions]
    finish = "tool_calls"
  else:
    # Malformed or plain text: hand back the raw text (special tokens stripped).
    message["content"] = tokenizer.decode(list(completion.output_ids), skip_special_tokens=True)
  return {
      "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
      "created": int(time.time()), "model": model_name,
      "choices": [{"index": 0, "message": message, "finish_reason": finish,
                   "logprobs": None}],
      "usage": {"prompt_tokens": completion.prompt_tokens,
                "completion_tokens": len(completion.output_ids),
                "total_tokens": completion.prompt_tokens + len(completion.output_ids)},
      "system_fingerprint": completion.weight_version,
  }
