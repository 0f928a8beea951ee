"""Reads the tool calls of a generated assistant turn, in the syntax of the policy's model family.

Task data stays model-neutral: an action is `{"name": "execute_code", "arguments": {"language":
..., "code": ...}, "thought": str}`. The tool-call *syntax* is a property of the model family:

- `qwen3_5` / `qwen3_5_text`: XML (Qwen3-Coder's syntax), `<tool_call>\\n<function=NAME>\\n
  <parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`;
- `qwen3`: JSON, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Malformed output is a `ParseError` the agent is shown, never an exception (tunix's
`parser/tool_parser` is the model for this split). `chat_format.ChatFormat` renders the calls this
module reads.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Iterator, Mapping, Sequence

from bat_jax.model.tokenizer import (CALL_CLOSE, CALL_OPEN, CONTROL_TOKENS, ENDOFTEXT, IM_END,
                                     THINK_CLOSE, THINK_OPEN)

MAX_TURN_CHARS = 65536
_MAX_PARSE_STEPS = 20000  # closing-tag candidates tried; bounds adversarial backtracking
_MAX_CALLS = _MAX_PARAMETERS = 64  # per turn / per call; also bounds the recursion depth


@dataclasses.dataclass(frozen=True)
class ParseError:
  """Why an assistant turn could not be turned into tool calls (shown to the agent)."""
  message: str


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """One assistant turn. `actions` are model-neutral: {"name", "arguments", "thought"}.

  `error` is set (and `actions` empty) when the turn is malformed; a turn with no tool call at all
  is not an error (`actions == ()`), the agent loop decides what that means.
  """
  actions: tuple[dict[str, Any], ...] = ()
  thought: str = ""
  error: ParseError | None = None

  @property
  def ok(self) -> bool:
    return self.error is None


class _Unreadable(Exception):
  """Stops the whole parse: a limit was hit, so no other reading of the turn is tried."""


class _Failure:
  """The parse failure that got furthest into the text (the most useful message), plus a budget."""

  def __init__(self):
    self.pos, self.message, self.steps = -1, "no tool call found", 0

  def at(self, pos: int, message: str) -> None:
    if pos > self.pos:
      self.pos, self.message = pos, message

  def step(self) -> None:
    self.steps += 1
    if self.steps > _MAX_PARSE_STEPS:
      raise _Unreadable(f"tool calls too ambiguous to read (over {_MAX_PARSE_STEPS} closing-tag "
                        f"candidates); first problem: {self.message}")


_WS = re.compile(r"\s*")
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_XML_PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>")
_XML_CLOSE = re.compile(r"\s*</function>\s*</tool_call>")
_JSON_CLOSE = re.compile(r"\s*</tool_call>")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


def _snippet(text: str, pos: int) -> str:
  return repr(text[pos:pos + 40] + ("..." if len(text) > pos + 40 else ""))


def _xml_calls(text: str, pos: int, fail: _Failure) -> Iterator[tuple[tuple[str, list], int]]:
  """Structural parses of one XML call body starting after `<tool_call>`: ((name, params), end)."""
  m = _XML_FUNCTION.match(text, pos)
  if not m:
    fail.at(pos, f"expected <function=NAME> after <tool_call>, got {_snippet(text, pos)}")
    return
  yield from _xml_parameters(text, m.end(), m.group(1).strip(), [], fail)


def _xml_parameters(text: str, pos: int, name: str, params: list[tuple[str, str]],
                    fail: _Failure) -> Iterator[tuple[tuple[str, list], int]]:
  m = _XML_PARAMETER.match(text, pos)
  if m and len(params) >= _MAX_PARAMETERS:
    raise _Unreadable(f"<function={name}> has more than {_MAX_PARAMETERS} parameters")
  if m:
    pname, start = m.group(1).strip(), m.end()
    start += text.startswith("\n", start)  # the renderer wraps each value in newlines
    # A value may itself contain "</parameter>" (code!): try every closing tag, shortest first,
    # and let the rest of the turn decide which one is structural.
    close = text.find("</parameter>", start)
    if close < 0:
      fail.at(m.start() + 1, f"unclosed <parameter={pname}> in <function={name}>: "
              "no </parameter> before the end of the turn")
    while close >= 0:
      fail.step()
      value = text[start:close]
      value = value[:-1] if value.endswith("\n") else value
      yield from _xml_parameters(text, close + len("</parameter>"), name,
                                 params + [(pname, value)], fail)
      close = text.find("</parameter>", close + 1)
    return
  m = _XML_CLOSE.match(text, pos)
  if m:
    yield (name, params), m.end()
  elif _WS.match(text, pos).end() == len(text):
    fail.at(pos, f"unclosed <function={name}> / <tool_call>: the turn ends before "
            "</function></tool_call>")
  else:
    fail.at(pos, f"expected <parameter=NAME> or </function></tool_call> in <function={name}>, "
            f"got {_snippet(text, _WS.match(text, pos).end())}")


def _json_calls(text: str, pos: int, fail: _Failure) -> Iterator[tuple[Any, int]]:
  """The structural parse of one JSON call body starting after `<tool_call>`: (object, end)."""
  start = _WS.match(text, pos).end()
  try:
    obj, end = json.JSONDecoder().raw_decode(text, start)
  except json.JSONDecodeError as e:
    fail.at(start, f"tool call is not valid JSON: {e.msg} at offset {e.pos - start}")
    return
  m = _JSON_CLOSE.match(text, end)
  if m:
    yield obj, m.end()
  else:
    fail.at(end, "unclosed <tool_call>: expected </tool_call> after the JSON object, got "
            f"{_snippet(text, _WS.match(text, end).end())}")


def structure_breaker(thought: Any, args: Mapping[str, Any]) -> tuple[str, str] | None:
  """(field, token) of the first action value a rendered turn could not hold, or None.

  The renderer refuses these (`ChatFormat`); the parser turns them into a ParseError, so a parsed
  action always renders back into the next prompt."""
  fields = {"thought": thought, **{f"arguments.{k}": v for k, v in args.items()}}
  for field, value in fields.items():
    for token in CONTROL_TOKENS + ((CALL_OPEN, THINK_CLOSE) if field == "thought" else ()):
      if isinstance(value, str) and token in value:
        return field, token
  return None


class ToolParser:
  """Parses assistant turns of one model family into model-neutral actions.

  Attributes:
    family: `qwen3` (JSON tool calls) or `qwen3_5` (XML tool calls).
    tool_specs: function name -> its schema; tool calls are validated against them.
    enable_thinking: the prompt opened a `<think>` block (Qwen3.5 with thinking on), so the turn
      starts inside the reasoning.
    max_turn_chars: longer assistant turns are a ParseError.
  """

  def __init__(self, family: str, tools: Sequence[Mapping[str, Any]], *, enable_thinking: bool,
               max_turn_chars: int = MAX_TURN_CHARS):
    self.family = family
    self.enable_thinking = enable_thinking
    self.max_turn_chars = max_turn_chars
    self.tool_specs: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
      spec = tool.get("function", tool)
      if not isinstance(spec.get("name"), str):
        raise ValueError(f"tools[{i}] has no function name: {tool!r}")
      self.tool_specs[spec["name"]] = spec

  def parse(self, text: str) -> ParsedTurn:
    """Tool calls of a generated assistant turn; malformed output is a ParseError, never raised."""
    try:
      return self._parse(text)
    except Exception as e:  # pylint: disable=broad-except  # a bad turn must not stop a rollout
      return ParsedTurn(error=ParseError(f"could not parse the turn ({type(e).__name__}: {e})"))

  def _parse(self, text: str) -> ParsedTurn:
    if not isinstance(text, str):
      return ParsedTurn(error=ParseError(f"turn must be text, got {type(text).__name__}"))
    for stop in (IM_END, ENDOFTEXT):
      text = text.split(stop, 1)[0]
    if len(text) > self.max_turn_chars:
      return ParsedTurn(error=ParseError(
          f"turn is {len(text)} characters, over the {self.max_turn_chars}-character limit"))
    reasoning, rest = "", text
    opened = self.enable_thinking and self.family == "qwen3_5"  # the prompt opened <think>
    if opened or text.lstrip().startswith(THINK_OPEN):
      if THINK_CLOSE not in text:
        return ParsedTurn(error=ParseError(
            "unclosed <think> block: the turn ends before </think>"))
      reasoning, rest = text.split(THINK_CLOSE, 1)
      reasoning = reasoning.split(THINK_OPEN, 1)[-1] if not opened else reasoning
    start = rest.find(CALL_OPEN)
    content = rest if start < 0 else rest[:start]
    thought = "\n\n".join(p for p in (reasoning.strip(), content.strip()) if p)
    if start < 0:
      for stray in ("<function=", CALL_CLOSE):
        if stray in rest:
          return ParsedTurn(thought=thought, error=ParseError(
              f"found {stray!r} outside a <tool_call> block; wrap each call in "
              "<tool_call>...</tool_call>"))
      return ParsedTurn(thought=thought)
    # The first complete structural reading wins (closing tags tried shortest first); its
    # semantic errors are reported, not explored further, so e.g. an extra parameter is named
    # instead of being read as part of the previous value.
    fail = _Failure()
    try:
      calls = next(self._structural_parses(rest, start, [], fail), None)
    except _Unreadable as e:
      return ParsedTurn(thought=thought, error=ParseError(str(e)))
    if calls is None:
      return ParsedTurn(thought=thought, error=ParseError(fail.message))
    actions = []
    for call in calls:
      action, error = self._validate(call)
      if error:
        return ParsedTurn(thought=thought, error=ParseError(error))
      actions.append(action)
    actions[0]["thought"] = thought
    for action in actions:
      broken = structure_breaker(action.get("thought", ""), action["arguments"])
      if broken:  # e.g. a `<tool_call>` inside the reasoning: the next prompt could not hold it
        return ParsedTurn(thought=thought, error=ParseError(
            f"the turn's {broken[0]} contains {broken[1]!r}, which would break the turn "
            "structure"))
    return ParsedTurn(actions=tuple(actions), thought=thought)

  def _structural_parses(self, text: str, pos: int, calls: list, fail: _Failure) -> Iterator[list]:
    """Every way to read text[pos:] as `<tool_call>...</tool_call>` blocks and whitespace."""
    body = _xml_calls if self.family == "qwen3_5" else _json_calls
    for call, end in body(text, pos + len(CALL_OPEN), fail):
      nxt = _WS.match(text, end).end()
      if nxt == len(text):
        yield calls + [call]
      elif text.startswith(CALL_OPEN, nxt) and len(calls) + 1 >= _MAX_CALLS:
        raise _Unreadable(f"more than {_MAX_CALLS} tool calls in one turn")
      elif text.startswith(CALL_OPEN, nxt):
        yield from self._structural_parses(text, nxt, calls + [call], fail)
      else:
        fail.at(nxt, f"unexpected text after </tool_call>: {_snippet(text, nxt)}; nothing may "
                "follow the tool calls")

  def _validate(self, call: Any) -> tuple[dict[str, Any] | None, str | None]:
    """A structural call -> (model-neutral action, None) or (None, what is wrong)."""
    if self.family == "qwen3":
      if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        keys = sorted(call) if isinstance(call, dict) else type(call).__name__
        return None, f'tool call must be a JSON object with keys "name" and "arguments", got {keys}'
      name, raw_args = call["name"], call["arguments"]
      if not isinstance(name, str):
        return None, f"tool call name must be a string, got {name!r}"
      if not isinstance(raw_args, dict):
        return None, f"arguments of {name} must be a JSON object, got {type(raw_args).__name__}"
      pairs, from_text = list(raw_args.items()), False
    else:
      (name, pairs), from_text = call, True
    spec = self.tool_specs.get(name)
    if spec is None:
      return None, f"unknown function {name!r}; available: {sorted(self.tool_specs)}"
    params = spec.get("parameters", {})
    props, required = params.get("properties", {}), params.get("required", [])
    args: dict[str, Any] = {}
    for key, value in pairs:
      if key in args:
        return None, f"parameter {key!r} of {name} is given twice"
      if key not in props:
        return None, f"unexpected parameter {key!r} for {name}; expected {sorted(props)}"
      value, error = _typed_value(value, props[key], from_text)
      if error:
        return None, f"parameter {key!r} of {name}: {error}"
      args[key] = value
    missing = [k for k in required if k not in args]
    if missing:
      return None, f"missing required parameter(s) {missing} for {name}"
    return {"name": name, "arguments": args, "thought": ""}, None


def _typed_value(value: Any, schema: Mapping[str, Any], from_text: bool) -> tuple[Any, str | None]:
  """Checks (and, for XML text, converts) a parameter value against its JSON schema."""
  kind = schema.get("type", "string")
  if from_text and kind != "string":
    text = value.strip()
    literal = {"True": "true", "False": "false", "None": "null"}.get(text, text)
    try:
      value = json.loads(literal)
    except json.JSONDecodeError:
      return None, f"expected {kind}, got {_snippet(text, 0)}"
  types = _JSON_TYPES.get(kind)
  if types is None:
    return None, f"unsupported schema type {kind!r}"
  if not isinstance(value, types) or (kind in ("integer", "number") and isinstance(value, bool)):
    return None, f"expected {kind}, got {type(value).__name__} {_snippet(str(value), 0)}"
  if "enum" in schema and value not in schema["enum"]:
    return None, f"must be one of {schema['enum']}, got {value!r}"
  return value, None
