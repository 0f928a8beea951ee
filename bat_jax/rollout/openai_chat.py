"""OpenAI chat-completions <-> model-neutral messages, for `bat_jax.rollout.server`.

OpenAI clients send assistant tool calls with `function.arguments` as a JSON *string*; the
chat templates want a mapping. Answers carry the parsed tool calls the same way OpenAI does
(`message.tool_calls[i].function.arguments` is a JSON string).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Mapping, Sequence

from bat_jax.model.chat_format import ChatFormat



def openai_to_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
  """Validates OpenAI messages and converts tool-call arguments to mappings."""
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping):
      raise ValueError(f"messages[{i}] must be an object")
    role = m.get("role")
    if role == "developer":  # OpenAI's newer name for the system role (o1 and later)
      role = "system"
    if role not in ("system", "user", "assistant", "tool"):
      raise ValueError(f"messages[{i}].role = {role!r} is not "
                       "system|developer|user|assistant|tool")
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


def assistant_turn(special_text: str, plain_text: str, chat_format: ChatFormat, *,
                   parse_tools: bool, cut_at_length: bool) -> tuple[dict[str, Any], str]:
  """OpenAI `message` and `finish_reason` of one generated assistant turn.

  Tool calls are read by `chat_format.parse_actions`, the parser the training rollouts use. A
  well-formed call gives `tool_calls` (arguments as a JSON string, as OpenAI) and finish
  "tool_calls"; anything else, a malformed call included, is plain text with finish "stop"
  ("length" when the token limit cut it).

  Args:
    special_text: the turn decoded with special tokens kept (what the parser reads).
    plain_text: the turn decoded without special tokens (the text answer).
    chat_format: a ChatFormat whose tools are the request's tools.
    parse_tools: False for requests without tools or with tool_choice "none".
    cut_at_length: generation ended at the token limit.
  """
  if parse_tools:
    parsed = chat_format.parse_actions(special_text)
    if parsed.error is None and parsed.actions:
      return {"role": "assistant", "content": parsed.thought or None,
              "tool_calls": [tool_call(a["name"], a["arguments"]) for a in parsed.actions]
              }, "tool_calls"
  return {"role": "assistant", "content": plain_text}, "length" if cut_at_length else "stop"


def tool_call(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
  """One OpenAI `tool_calls` entry."""
  return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
