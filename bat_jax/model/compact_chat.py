"""A compact tool preamble for small policies trained from scratch (`tokenizer.tool_preamble`).

The Qwen chat templates put ~650 tokens of tool instructions (the JSON schema plus an IMPORTANT
block) into every system message. A from-scratch tiny policy gains nothing from them: it learns
the call syntax from its SFT rows. `CompactToolsChatFormat` renders the same family template
*without* its tool block and states the tools in a few lines at the top of the system message
instead, so a row is ~3x shorter. Everything else (call syntax, observation deltas, parsing and
validation against the tool schemas) is the family's `ChatFormat`, unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from bat_jax import io_utils
from bat_jax.model import chat_format as chat_format_lib
from bat_jax.model import tokenizer as tokenizer_lib

PREAMBLES: tuple[str, ...] = ("template", "compact")


def _signature(tool: Mapping[str, Any]) -> str:
  """`name(p: a|b, q)`: a tool's parameters, with the allowed values of enum parameters."""
  spec = tool.get("function", tool)
  props = spec.get("parameters", {}).get("properties", {})
  params = [f"{k}: {'|'.join(v['enum'])}" if "enum" in v else k for k, v in props.items()]
  return f"{spec['name']}({', '.join(params)})"


def compact_preamble(tools: Sequence[Mapping[str, Any]], family: str) -> str:
  """A few lines naming each tool and the family's call syntax (an empty call as the example)."""
  lines = [f"Tool {_signature(t)}: {t.get('function', t).get('description', '')}".rstrip()
           for t in tools]
  if family == "qwen3":
    syntax = (f'{tokenizer_lib.CALL_OPEN}\n{{"name": NAME, "arguments": {{...}}}}\n'
              f"{tokenizer_lib.CALL_CLOSE}")
  else:
    syntax = (f"{tokenizer_lib.CALL_OPEN}\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n"
              f"</function>\n{tokenizer_lib.CALL_CLOSE}")
  return "\n".join(lines + [f"Call a tool as {syntax}"])


class CompactToolsChatFormat(chat_format_lib.ChatFormat):
  """The family's `ChatFormat` with `compact_preamble` in place of the template's tool block."""

  def render_messages(self, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None = None, *,
                      add_generation_prompt: bool, **template_kwargs: Any) -> str:
    tools = self.tools if tools is None else tuple(tools)
    msgs = [dict(m) for m in messages]
    if tools:
      preamble = compact_preamble(tools, self.family)
      if msgs and msgs[0].get("role") == "system":
        msgs[0]["content"] = f"{preamble}\n\n{msgs[0].get('content', '')}"
      else:
        msgs.insert(0, {"role": "system", "content": preamble})
    return super().render_messages(msgs, (), add_generation_prompt=add_generation_prompt,
                                   **template_kwargs)


# The tokenizer_config.json field that records the chat format a policy was trained with; every
# export copies the run's tokenizer files, so `python -m bat_jax.serve` serves that format.
CHAT_FORMAT_FIELD = "bat_jax_chat_format"


def record_chat_format(tokenizer_dir: str | os.PathLike, preamble: str) -> None:
  """Writes {"tool_preamble": preamble} into tokenizer_dir/tokenizer_config.json (idempotent)."""
  if preamble not in PREAMBLES:
    raise ValueError(f"unknown tokenizer.tool_preamble {preamble!r}; expected one of "
                     f"{PREAMBLES}")
  path = Path(tokenizer_dir) / "tokenizer_config.json"
  config = json.loads(path.read_text(encoding="utf-8"))
  if config.get(CHAT_FORMAT_FIELD) != {"tool_preamble": preamble}:
    config[CHAT_FORMAT_FIELD] = {"tool_preamble": preamble}
    io_utils.atomic_write_text(path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def recorded_preamble(tokenizer_dir: str | os.PathLike) -> str:
  """The tool preamble a policy folder records ("template" when it records none)."""
  path = Path(tokenizer_dir) / "tokenizer_config.json"
  config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
  preamble = (config.get(CHAT_FORMAT_FIELD) or {}).get("tool_preamble", "template")
  if preamble not in PREAMBLES:
    raise ValueError(f"{path}: {CHAT_FORMAT_FIELD}.tool_preamble = {preamble!r} is not one of "
                     f"{PREAMBLES}")
  return preamble


def chat_format_for(preamble: str, model_type: str, tokenizer: Any,
                    **kwargs: Any) -> chat_format_lib.ChatFormat:
  """The chat format of `model_type` with the template's tool block or the compact one."""
  if preamble not in PREAMBLES:
    raise ValueError(f"unknown tokenizer.tool_preamble {preamble!r}; expected one of "
                     f"{PREAMBLES}")
  cls = CompactToolsChatFormat if preamble == "compact" else chat_format_lib.ChatFormat
  return cls.for_model(model_type, tokenizer, **kwargs)
