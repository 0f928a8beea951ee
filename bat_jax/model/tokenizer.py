"""Tokenizer, chat format and tool-call render/parse for the Qwen3 / Qwen3.5 policies.

Task data stays model-neutral: an action is `{"name": "execute_code", "arguments": {"language":
..., "code": ...}, "thought": str}`. The tool-call *syntax* is a property of the model family and is
chosen here, at tokenisation time:

- `qwen3_5` / `qwen3_5_text`: XML (Qwen3-Coder's syntax), `<tool_call>\\n<function=NAME>\\n
  <parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`;
- `qwen3`: JSON, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Rollouts are token-in/token-out: the prompt is encoded once, the policy's sampled ids are kept as
they are (ending with the `<|im_end|>` stop token) and each tool result is appended as
`encode_observation_delta`, the exact tokens the family's chat template adds for that tool message.
The templates (`chat_templates/*.jinja`) reproduce the official Qwen renderings for text content.
Everything reads local directories only; nothing touches the hub.

Two properties of the official templates, kept as they are: Qwen3 with `enable_thinking=False`
drops the empty `<think></think>` of earlier turns when re-rendering, so a multi-turn rollout stream
is not a prefix of the re-rendered conversation (the deltas are still the template's); and with
thinking on, an empty Qwen3.5 reasoning ("<think>\\n" + "\\n</think>") re-tokenises its two newlines
as one token. In every other case prompt + turns + deltas equal the template token-for-token.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import re
from typing import Any, Iterable, Iterator, Mapping, Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
import transformers

from bat_jax import io_utils, workflow

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# Control tokens are `special` (dropped by skip_special_tokens); markup tokens are not, as in Qwen,
# so decoded text (e.g. an SGLang response) keeps the tool-call and think tags.
CONTROL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
MARKUP_TOKENS: tuple[str, ...] = (
    CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, THINK_OPEN, THINK_CLOSE)
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")
# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation, newlines.
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# model_type (config.json) -> chat family (template file, tool-call syntax).
FAMILY_OF_MODEL_TYPE: Mapping[str, str] = {
    "qwen3": "qwen3", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"}
TEMPLATE_DIR = pathlib.Path(__file__).with_name("chat_templates")
MAX_TURN_CHARS = 65536
_MAX_PARSE_STEPS = 20000  # closing-tag candidates tried; bounds adversarial backtracking
_MAX_CALLS = _MAX_PARAMETERS = 64  # per turn / per call; also bounds the recursion depth


def chat_template(family: str) -> str:
  """The Jinja chat template of a chat family (`qwen3` or `qwen3_5`)."""
  path = TEMPLATE_DIR / f"{family}.jinja"
  if not path.is_file():
    raise ValueError(f"unknown chat family {family!r}; expected one of "
                     f"{sorted(set(FAMILY_OF_MODEL_TYPE.values()))}")
  return path.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Training and loading.
# ---------------------------------------------------------------------------------------------

def train_tokenizer(corpus: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, *,
                    chat_family: str = "qwen3_5", min_frequency: int = 2) -> pathlib.Path:
  """Trains a byte-level BPE tokenizer in HF format with Qwen's special tokens and chat template.

  Args:
    corpus: training texts.
    vocab_size: total vocabulary size, special tokens included. A small corpus may yield fewer
      merges; `len(load_tokenizer(out_dir))` is the real size (never above `vocab_size`).
    out_dir: directory to write `tokenizer.json`, `tokenizer_config.json` and
      `special_tokens_map.json` into (created if missing).
    chat_family: whose chat template goes into `tokenizer_config.json` (`qwen3_5` or `qwen3`).
    min_frequency: minimum pair count for a merge.

  Returns:
    `out_dir` as a Path; loadable by `load_tokenizer`, `AutoTokenizer` and SGLang.
  """
  template = chat_template(chat_family)
  floor = 256 + len(CONTROL_TOKENS) + len(MARKUP_TOKENS)
  if vocab_size <= floor:
    raise ValueError(f"vocab_size={vocab_size} must exceed {floor} (256 bytes + special tokens)")
  tok = tokenizers.Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(PRETOKENIZE_REGEX), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size - len(MARKUP_TOKENS), min_frequency=min_frequency,
      special_tokens=list(CONTROL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  tok.train_from_iterator(corpus, trainer)
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                  for t in MARKUP_TOKENS])

  added = {str(tok.token_to_id(t)): {
      "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
      "special": t in CONTROL_TOKENS} for t in CONTROL_TOKENS + MARKUP_TOKENS}
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "added_tokens_decoder": added,
      "bos_token": None, "eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": None,
      "additional_special_tokens": [IM_START, IM_END],
      "clean_up_tokenization_spaces": False, "split_special_tokens": False,
      "model_max_length": 131072, "errors": "replace",
      "chat_template": template,
  }
  special_map = {"eos_token": IM_END, "pad_token": ENDOFTEXT,
                 "additional_special_tokens": [IM_START, IM_END]}
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  io_utils.atomic_write_text(out / "tokenizer.json", tok.to_str())
  io_utils.atomic_write_text(out / "tokenizer_config.json",
                             json.dumps(config, indent=2, ensure_ascii=False))
  io_utils.atomic_write_text(out / "special_tokens_map.json", json.dumps(special_map, indent=2))
  return out


def load_tokenizer(path: str | os.PathLike) -> transformers.PreTrainedTokenizerFast:
  """Loads a tokenizer from a local directory (never the hub); names any missing file."""
  path = pathlib.Path(path)
  if not path.is_dir():
    raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
  for name in TOKENIZER_FILES:
    if not (path / name).is_file():
      raise FileNotFoundError(f"tokenizer file {str(path / name)!r} is missing; a tokenizer "
                              f"directory needs {', '.join(TOKENIZER_FILES)}")
  tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
  if not isinstance(tok, transformers.PreTrainedTokenizerFast):
    raise TypeError(f"tokenizer in {str(path)!r} loaded as {type(tok).__name__}, "
                    "expected a fast (tokenizers-backed) tokenizer")
  return tok


_WORDS = ("plan setup validate infer submit stage rubric workspace evidence sandbox model case "
          "image mask label volume slice patient scan report score dice accuracy shape output "
          "input checkpoint pipeline receipt submission prediction coverage sample result check "
          "error failure recovery success diagnose correct verify run load save write read file "
          "data task track segmentation classification detection synthesis enhancement vqa the "
          "a of and to in is for with on it that this we all small non degenerate expected").split()
_CODE = (
    "import json\nfrom pathlib import Path\nprint(sorted(p.name for p in Path('.').iterdir()))\n",
    "with open('plan/plan.md', 'w') as f:\n    f.write('# Plan\\n- preprocess\\n- inference\\n')\n",
    "data = json.loads(Path('task/spec.json').read_text())\nprint(data['track'], len(data))\n",
    "for i, case in enumerate(cases):\n    pred = model(case)\n"
    "    assert pred.shape == (4, 4), i\n",
    "ls -la data && python pipeline/infer.py --cases data --out outputs/predictions.jsonl\n",
    "sha256sum models/weights.json | cut -d' ' -f1 > setup/checkpoint.sha\ncat setup/*.json\n",
    "if not rows:\n    raise SystemExit('no predictions written')\nprint(f'{len(rows)} rows ok')\n",
)


def _tool_call_samples(rng: random.Random) -> list[str]:
  code = rng.choice(_CODE)
  lang = rng.choice(workflow.TOOL_LANGUAGES)
  xml = (f"{CALL_OPEN}\n<function=execute_code>\n<parameter=language>\n{lang}\n</parameter>\n"
         f"<parameter=code>\n{code}\n</parameter>\n</function>\n{CALL_CLOSE}")
  call = json.dumps({"name": "execute_code", "arguments": {"language": lang, "code": code}},
                    ensure_ascii=False)
  obs = workflow.format_observation(rng.randint(0, 2), f"{rng.randint(0, 999)} cases\n", "")
  return [xml, f"{CALL_OPEN}\n{call}\n{CALL_CLOSE}",
          f"{IM_START}user\n{RESPONSE_OPEN}\n{obs}\n{RESPONSE_CLOSE}{IM_END}\n"]


def tiny_corpus(num_docs: int = 300, seed: int = 0) -> list[str]:
  """A small deterministic corpus (prose, code, tool calls, observations) for tiny tokenizers.

  `train_tokenizer(tiny_corpus(), 1024, d)` takes well under a second; tests use it to build a
  tokenizer without any download.
  """
  rng = random.Random(seed)
  docs = [json.dumps(workflow.TOOL_SCHEMA), "Ünïcödé: naïve café — 日本語 テキスト 🙂 ±≤≥"]
  syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
  for i in range(num_docs):
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 40)))
    names = " ".join("".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(12))
    docs.append(f"{words.capitalize()}. Stage S{i % 5 + 1} scored {rng.random():.3f}. {names}")
    docs.append(rng.choice(_CODE))
    docs.extend(_tool_call_samples(rng))
  return docs


# ---------------------------------------------------------------------------------------------
# Parsed turns.
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# The chat format of a model family.
# ---------------------------------------------------------------------------------------------

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
    self._tool_specs = {}
    for i, tool in enumerate(self.tools):
      spec = tool.get("function", tool)
      if not isinstance(spec.get("name"), str):
        raise ValueError(f"tools[{i}] has no function name: {tool!r}")
      self._tool_specs[spec["name"]] = spec
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
                      add_generation_prompt: bool) -> str:
    """The family template applied to messages; `{"role": "assistant", "action": a}` allowed."""
    msgs = [self.assistant_message(m["action"]) if m.get("role") == "assistant" and "action" in m
            else dict(m) for m in messages]
    return self.tokenizer.apply_chat_template(
        msgs, tools=list(self.tools if tools is None else tools), chat_template=self.template,
        tokenize=False, add_generation_prompt=add_generation_prompt,
        enable_thinking=self.enable_thinking)

  def encode_prompt(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Token ids of the conversation, ending with the assistant generation prompt."""
    return self.encode(self.render_messages(messages, tools, add_generation_prompt=True))

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
    fields = {"thought": thought, **{f"arguments.{k}": v for k, v in args.items()}}
    for field, value in fields.items():
      for token in CONTROL_TOKENS + ((CALL_OPEN, THINK_CLOSE) if field == "thought" else ()):
        if isinstance(value, str) and token in value:
          raise ValueError(f"action field {field!r} contains {token!r}, which would break the "
                           "turn structure")
    return thought.strip(), name, args

  def _call_text(self, name: str, args: Mapping[str, Any]) -> str:
    if self.family == "qwen3":
      args_json = json.dumps(dict(args), ensure_ascii=False)  # = the template's tojson
      return f'{CALL_OPEN}\n{{"name": "{name}", "arguments": {args_json}}}\n{CALL_CLOSE}'
    params = "".join(
        f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in args.items())
    return f"{CALL_OPEN}\n<function={name}>\n{params}</function>\n{CALL_CLOSE}"

  def render_action(self, action: Mapping[str, Any]) -> str:
    """The text the policy should generate after the generation prompt (without `<|im_end|>`)."""
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

  # --- parsing ---------------------------------------------------------------------------------

  def parse_actions(self, text: str) -> ParsedTurn:
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
    spec = self._tool_specs.get(name)
    if spec is None:
      return None, f"unknown function {name!r}; available: {sorted(self._tool_specs)}"
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


def _xml_value(value: Any) -> str:
  """An XML parameter value as the Qwen3.5 template writes it (tojson for containers, str else)."""
  if isinstance(value, (Mapping, list, tuple)):
    return json.dumps(value, ensure_ascii=False)
  return str(value)


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
