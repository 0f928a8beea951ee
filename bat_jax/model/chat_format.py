"""The chat format of the Qwen3 / Qwen3.5 policies: rendering, encoding, SFT examples and parsing.

Task data stays model-neutral (an action is `{"name", "arguments", "thought"}`); the tool-call
syntax is the model family's and is chosen here, at tokenisation time (`tool_parser` reads it back).

Rollouts are token-in/token-out: the prompt is encoded once, the policy's sampled ids are kept as
they are (ending with the `<|im_end|>` stop token) and each tool result is appended as
`encode_observation_delta`, the exact tokens the family's chat template adds for that tool message.
The templates (`chat_templates/*.jinja`) reproduce the official Qwen renderings for text content.

Two properties of the official templates, kept as they are: Qwen3 with `enable_thinking=False`
drops the empty `<think></think>` of earlier turns when re-rendering, so a multi-turn rollout stream
is not a prefix of the re-rendered conversation (the deltas are still the template's); and with
thinking on, an empty Qwen3.5 reasoning ("<think>\\n" + "\\n</think>") re-tokenises its two newlines
as one token. In every other case prompt + turns + deltas equal the template token-for-token.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import transformers

from bat_jax import workflow
from bat_jax.model import tool_parser
from bat_jax.model.tokenizer import (CALL_CLOSE, CALL_OPEN, CONTROL_TOKENS, ENDOFTEXT,
                                     FAMILY_OF_MODEL_TYPE, IM_END, IM_START, MARKUP_TOKENS,
                                     RESPONSE_CLOSE, RESPONSE_OPEN, THINK_CLOSE, THINK_OPEN,
                                     chat_template)
from bat_jax.model.tool_parser import MAX_TURN_CHARS, ParsedTurn


class ChatFormat:
  """Renders, encodes and parses conversations in one model family's native format.

  Attributes:
    family: `qwen3` (JSON tool calls) or `qwen3_5` (XML tool calls).
    tokenizer: the HF tokenizer.
    template: the family's Jinja chat template (used for prompts and as the reference).
    tools: the tool schemas the agent has; tool calls are validated against them.
    enable_thinking: the template's `enable_thinking`. True (the Qwen default) opens a `<think>`
      block in the generation prompt (Qwen3.5) or lets the model open one (Qwen3), and an action's
      thought is rendered as its reasoning. False closes an empty think block in the generation
      prompt and renders the thought as plain text before the tool call.
    max_turn_chars: longer assistant turns are a ParseError.
    parser: the family's `tool_parser.ToolParser` (what `parse_actions` runs).
  """

  def __init__(self, family: str, tokenizer: transformers.PreTrainedTokenizerBase, *,
               tools: Sequence[Mapping[str, Any]] = (workflow.TOOL_SCHEMA,),
               enable_thinking: bool = True, max_turn_chars: int = MAX_TURN_CHARS):
    self.family = family
    self.template = chat_template(family)
    self.tokenizer = tokenizer
    self.tools = tuple(tools)
    self.enable_thinking = enable_thinking
    self.max_turn_chars = max_turn_chars
    self.parser = tool_parser.ToolParser(family, self.tools, enable_thinking=enable_thinking,
                                         max_turn_chars=max_turn_chars)
    vocab = tokenizer.get_vocab()
    missing = [t for t in CONTROL_TOKENS + MARKUP_TOKENS if t not in vocab]
    if missing:
      raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} lacks the chat "
                       f"tokens {missing}")
    self.im_end_id = vocab[IM_END]
    self.endoftext_id = vocab[ENDOFTEXT]

  @classmethod
  def for_model(cls, model_type: str, tokenizer: transformers.PreTrainedTokenizerBase,
                **kwargs: Any) -> "ChatFormat":
    """The chat format of a `config.json` `model_type` (qwen3 | qwen3_5 | qwen3_5_text)."""
    if model_type not in FAMILY_OF_MODEL_TYPE:
      raise ValueError(f"unsupported model_type {model_type!r} for a chat format; expected one "
                       f"of {sorted(FAMILY_OF_MODEL_TYPE)}")
    return cls(FAMILY_OF_MODEL_TYPE[model_type], tokenizer, **kwargs)

  @property
  def stop_token_ids(self) -> tuple[int, ...]:
    """Generation stops on `<|im_end|>` (end of turn) or `<|endoftext|>`."""
    return (self.im_end_id, self.endoftext_id)

  @property
  def generation_prompt(self) -> str:
    """The text that opens an assistant turn (what the policy continues from)."""
    if not self.enable_thinking:
      return f"{IM_START}assistant\n{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"
    return f"{IM_START}assistant\n" + (f"{THINK_OPEN}\n" if self.family == "qwen3_5" else "")

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False)

  def decode(self, ids: Sequence[int]) -> str:
    """Token ids -> text, keeping every special token (what `parse_actions` expects)."""
    return self.tokenizer.decode(list(ids), skip_special_tokens=False)

  # --- rendering -------------------------------------------------------------------------------

  def render_messages(self, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None = None, *,
                      add_generation_prompt: bool, **template_kwargs: Any) -> str:
    """The family template applied to messages; `{"role": "assistant", "action": a}` allowed.

    `template_kwargs`: extra template variables (an OpenAI request's `chat_template_kwargs`)."""
    msgs = [self.assistant_message(m["action"]) if m.get("role") == "assistant" and "action" in m
            else dict(m) for m in messages]
    return self.tokenizer.apply_chat_template(
        msgs, tools=list(self.tools if tools is None else tools), chat_template=self.template,
        tokenize=False, add_generation_prompt=add_generation_prompt,
        **{**template_kwargs, "enable_thinking": self.enable_thinking})

  def encode_prompt(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
    """Token ids of the conversation, ending with the assistant generation prompt."""
    return self.encode(self.render_messages(messages, tools, add_generation_prompt=True,
                                            **template_kwargs))

  def _final_turn(self, action: Mapping[str, Any]) -> tuple[str, str] | None:
    """`(thought, text)` of a final turn (`{"thought", "final"}`: no tool call, the agent is
    done), else None."""
    if not isinstance(action, Mapping) or "final" not in action:
      return None
    thought, final = action.get("thought", ""), action["final"]
    if not isinstance(thought, str) or not isinstance(final, str) or not final.strip():
      raise ValueError(f"a final action needs string 'thought' and non-empty 'final', got "
                       f"{action!r:.200}")
    if "name" in action or "arguments" in action:
      raise ValueError("a final action carries no tool call ('name' / 'arguments')")
    broken = tool_parser.structure_breaker(thought + final, {})
    if broken:
      raise ValueError(f"final action contains {broken[1]!r}, which would break the turn")
    return thought.strip(), final.strip()

  def _thought_and_call(self, action: Mapping[str, Any]) -> tuple[str, str, Mapping[str, Any]]:
    if not isinstance(action, Mapping):
      raise ValueError(f"action must be a mapping, got {type(action).__name__}")
    name, args, thought = action.get("name"), action.get("arguments"), action.get("thought", "")
    if not isinstance(name, str) or not name:
      raise ValueError(f"action field 'name' must be a non-empty string, got {name!r}")
    if not isinstance(args, Mapping):
      raise ValueError(f"action field 'arguments' must be a mapping, got {args!r}")
    if not isinstance(thought, str):
      raise ValueError(f"action field 'thought' must be a string, got {thought!r}")
    broken = tool_parser.structure_breaker(thought, args)
    if broken:
      raise ValueError(f"action field {broken[0]!r} contains {broken[1]!r}, which would break "
                       "the turn structure")
    return thought.strip(), name, args

  def _call_text(self, name: str, args: Mapping[str, Any]) -> str:
    if self.family == "qwen3":
      args_json = json.dumps(dict(args), ensure_ascii=False)  # = the template's tojson
      return f'{CALL_OPEN}\n{{"name": "{name}", "arguments": {args_json}}}\n{CALL_CLOSE}'
    params = "".join(
        f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in args.items())
    return f"{CALL_OPEN}\n<function={name}>\n{params}</function>\n{CALL_CLOSE}"

  def render_action(self, action: Mapping[str, Any]) -> str:
    """The text the policy should generate after the generation prompt (without `<|im_end|>`):
    a tool call, or a final turn (`{"thought", "final"}`) that ends the episode."""
    final = self._final_turn(action)
    if final is not None:
      thought, call = final
    else:
      thought, name, args = self._thought_and_call(action)
      call = self._call_text(name, args)
    if self.enable_thinking and self.family == "qwen3_5":
      return f"{thought}\n{THINK_CLOSE}\n\n{call}"
    if self.enable_thinking:  # qwen3 lets the model open its own think block
      return f"{THINK_OPEN}\n{thought}\n{THINK_CLOSE}\n\n{call}" if thought else call
    separator = "\n\n" if self.family == "qwen3_5" else "\n"
    return f"{thought}{separator}{call}" if thought else call

  def assistant_message(self, action: Mapping[str, Any]) -> dict[str, Any]:
    """An HF-style assistant message that the template renders exactly like `render_action`."""
    thought, name, args = self._thought_and_call(action)
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function",
                               "function": {"name": name, "arguments": dict(args)}}]}
    if self.enable_thinking:
      message["reasoning_content"] = thought
    else:
      message["content"] = thought
    return message

  def encode_action(self, action: Mapping[str, Any]) -> list[int]:
    """Token ids of a whole assistant action turn, ending with the `<|im_end|>` stop token."""
    return self.encode(self.render_action(action)) + [self.im_end_id]

  def encode_observation_delta(self, observation: str | Sequence[str], *,
                               after_stop: bool = True) -> list[int]:
    """Tokens that close the assistant turn, add the tool result(s) and reopen an assistant turn.

    Equal to what the chat template appends for the tool message(s) after the assistant turn,
    generation prompt included; every token is context (loss mask 0).

    Args:
      observation: the tool observation, or one per tool call of the turn.
      after_stop: the assistant ids already end with `<|im_end|>` (generation stopped on it);
        False prepends it (e.g. a turn cut at the token limit).
    """
    observations = [observation] if isinstance(observation, str) else list(observation)
    if not observations or not all(isinstance(o, str) for o in observations):
      raise ValueError(f"observation must be a string or a non-empty list of strings, "
                       f"got {observation!r}")
    # Qwen3.5's template trims every message body; Qwen3's keeps it verbatim.
    bodies = [o.strip() if self.family == "qwen3_5" else o for o in observations]
    responses = "".join(f"\n{RESPONSE_OPEN}\n{b}\n{RESPONSE_CLOSE}" for b in bodies)
    text = f"\n{IM_START}user{responses}{IM_END}\n{self.generation_prompt}"
    return ([] if after_stop else [self.im_end_id]) + self.encode(text)

  def encode_sft_example(self, messages: Sequence[Mapping[str, Any]],
                         target_action: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of a context plus the target action turn, built like a rollout.

    The context is the messages up to the first assistant turn (templated once), then each earlier
    assistant turn (`{"role": "assistant", "action": a}`) and its tool results, appended exactly as
    a rollout appends them. The mask is 1 only on the target action's tokens and its `<|im_end|>`.
    """
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"),
                 len(messages))
    ids = self.encode_prompt(messages[:first])
    pending: list[str] = []
    for i, message in enumerate(messages[first:], start=first):
      role = message.get("role")
      if role == "tool":
        pending.append(message.get("content"))
      elif role == "assistant" and "action" in message and (i == first or pending):
        if pending:
          ids += self.encode_observation_delta(pending)
          pending = []
        ids += self.encode_action(message["action"])
      else:
        raise ValueError(f"messages[{i}]: after the first assistant turn, expected tool messages "
                         "and {'role': 'assistant', 'action': ...} turns that follow them, got "
                         f"role {role!r}")
    if first < len(messages):
      if not pending:
        raise ValueError("the last assistant turn in messages has no tool result after it")
      ids += self.encode_observation_delta(pending)
    target = self.encode_action(target_action)
    return ids + target, [0] * len(ids) + [1] * len(target)

  def parse_actions(self, text: str) -> ParsedTurn:
    """Tool calls of a generated assistant turn; malformed output is a ParseError, never raised."""
    return self.parser.parse(text)


def _xml_value(value: Any) -> str:
  """An XML parameter value as the Qwen3.5 template writes it (tojson for containers, str else)."""
  if isinstance(value, (Mapping, list, tuple)):
    return json.dumps(value, ensure_ascii=False)
  return str(value)

