"""Tokenizer training/loading, chat templates, tool-call render/parse, deltas and SFT masks."""

import json
import shutil

import hypothesis
from hypothesis import strategies as st
import pytest
import tokenizers
import transformers

from bat_jax import workflow
from bat_jax.model import tokenizer as tk

FAMILY_MODES = [("qwen3", True), ("qwen3", False), ("qwen3_5", True), ("qwen3_5", False)]
# Qwen3's official template drops the empty <think></think> of earlier turns when thinking is off,
# so only the other modes re-render a rollout stream token-for-token (checked below).
PREFIX_STABLE_MODES = [m for m in FAMILY_MODES if m != ("qwen3", False)]

ACTIONS = [
    {"name": "execute_code", "thought": "Inspect the workspace first.",
     "arguments": {"language": "python", "code": (
         "from pathlib import Path\nprint(sorted(p.name for p in Path('.').iterdir()))")}},
    {"name": "execute_code", "thought": "",
     "arguments": {"language": "bash", "code": "echo \"it's \\\"quoted\\\"\" && ls -la data\n"}},
    {"name": "execute_code", "thought": "Unicode: naïve 日本語 🙂",
     "arguments": {"language": "python", "code": "\n\nx = 'naïve 日本語 🙂 ±≤'\nprint(x)\n\n"}},
    {"name": "execute_code", "thought": "Code that looks like markup.",
     "arguments": {"language": "python", "code": (
         "s = '<tool_call>\\n<function=f>\\n<parameter=code>\\n'\n"
         "print('</parameter>\\n</function>\\n</tool_call>')\n"
         "<parameter=language>\nbash\n</parameter>\n</function>\n</tool_call>\n"
         "t = \"</think><tool_response>{\\\"name\\\": 1}</tool_response>\"")}},
    {"name": "execute_code", "thought": "  padded thought\n\n",
     "arguments": {"language": "bash", "code": ""}},
]
OBSERVATIONS = [
    workflow.format_observation(0, "['data', 'models', 'task']\n", ""),
    workflow.format_observation(1, "", "Traceback: naïve 日本語 error\n  line 2\n"),
    "  leading and trailing whitespace  \n\n",
]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
  return tk.train_tokenizer(tk.tiny_corpus(), 1024, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
  return tk.load_tokenizer(tokenizer_dir)


def _format(tokenizer, family, thinking):
  return tk.ChatFormat(family, tokenizer, enable_thinking=thinking)


def _context():
  return [{"role": "system", "content": "Complete the workflow using observable evidence."},
          {"role": "user", "content": "Inspect the files and run a small validation."}]


def _expected_action(action):
  return {**action, "thought": action["thought"].strip()}


# --- training and loading ----------------------------------------------------------------------

def test_trained_tokenizer_loads_with_auto_tokenizer_and_round_trips(tokenizer_dir):
  tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
  assert isinstance(tok, transformers.PreTrainedTokenizerFast)
  assert len(tok) == 1024
  assert tok.eos_token == tk.IM_END and tok.pad_token == tk.ENDOFTEXT
  for token in tk.CONTROL_TOKENS + tk.MARKUP_TOKENS:
    assert len(tok.encode(token, add_special_tokens=False)) == 1, token
  text = ("Plan: segment 12 cases — naïve café 日本語 🙂\n\tdef f(x):\n        return x ** 2\n"
          "<tool_call>\n<function=execute_code>\n</function>\n</tool_call><|im_end|>\n")
  ids = tok.encode(text, add_special_tokens=False)
  assert tok.decode(ids) == text
  assert len(ids) < len(text.encode())  # BPE merged something
  # Control tokens are special (skipped); tool-call and think tags survive, as in Qwen.
  assert tok.decode(ids, skip_special_tokens=True) == text.replace(tk.IM_END, "")
  config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
  assert config["chat_template"] == tk.chat_template("qwen3_5")
  rendered = tok.apply_chat_template(_context(), tokenize=False, add_generation_prompt=True)
  assert rendered.endswith(f"{tk.IM_START}assistant\n{tk.THINK_OPEN}\n")


def test_train_tokenizer_rejects_too_small_vocab(tmp_path):
  with pytest.raises(ValueError, match="vocab_size=200"):
    tk.train_tokenizer(["abc"], 200, tmp_path)


@pytest.mark.parametrize("missing", tk.TOKENIZER_FILES)
def test_load_tokenizer_names_missing_file(tokenizer_dir, tmp_path, missing):
  broken = tmp_path / "broken"
  shutil.copytree(tokenizer_dir, broken)
  (broken / missing).unlink()
  with pytest.raises(FileNotFoundError, match=missing):
    tk.load_tokenizer(broken)
  with pytest.raises(FileNotFoundError, match="nowhere"):
    tk.load_tokenizer(tmp_path / "nowhere")


def test_chat_format_rejects_unknown_model_type_and_incomplete_tokenizer(tokenizer):
  with pytest.raises(ValueError, match="llama"):
    tk.ChatFormat.for_model("llama", tokenizer)
  assert tk.ChatFormat.for_model("qwen3_5_text", tokenizer).family == "qwen3_5"
  raw = tokenizers.Tokenizer(tokenizers.models.BPE())
  raw.add_special_tokens([tk.IM_START, tk.IM_END])
  bare = transformers.PreTrainedTokenizerFast(tokenizer_object=raw)
  with pytest.raises(ValueError, match=r"<\|endoftext\|>"):
    tk.ChatFormat("qwen3", bare)
  fmt = tk.ChatFormat.for_model("qwen3", tokenizer)
  assert fmt.stop_token_ids == (tokenizer.convert_tokens_to_ids(tk.IM_END),
                                tokenizer.convert_tokens_to_ids(tk.ENDOFTEXT))


# --- templates -------------------------------------------------------------------------------

_WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"},
                                         "verbose": {"type": "boolean"}},
        "required": ["location"]}}}
_WEATHER_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "I'll check.", "tool_calls": [{
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"location": "Paris", "verbose": True}}}]},
    {"role": "tool", "content": "22C"},
    {"role": "user", "content": "Thanks"},
]
_WEATHER_TOOL_JSON = ('{"type": "function", "function": {"name": "get_weather", "parameters": '
                      '{"type": "object", "properties": {"location": {"type": "string"}, '
                      '"verbose": {"type": "boolean"}}, "required": ["location"]}}}')
# Test vectors rendered by the official Qwen/Qwen3.5-27B and Qwen/Qwen3-8B chat templates.
GOLDEN = {
    "qwen3_5": (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + _WEATHER_TOOL_JSON + "\n</tools>\n\nIf you choose to call a function ONLY reply in the "
        "following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
        "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\n"
        "This is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n"
        "</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the "
        "specified format: an inner <function=...></function> block must be nested within "
        "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may "
        "provide optional reasoning for your function call in natural language BEFORE the function "
        "call, but NOT after\n- If there is no function call available, answer the question like "
        "normal with your current knowledge and do not tell the user about function calls\n"
        "</IMPORTANT>\n\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat's the "
        "weather in Paris?<|im_end|>\n<|im_start|>assistant\nI'll check.\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=verbose>\n"
        "True\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n"
        "<tool_response>\n22C\n</tool_response><|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"),
    "qwen3": (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more "
        "functions to assist with the user query.\n\nYou are provided with function signatures "
        "within <tools></tools> XML tags:\n<tools>\n" + _WEATHER_TOOL_JSON + "\n</tools>\n\nFor "
        "each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWhat's the "
        "weather in Paris?<|im_end|>\n<|im_start|>assistant\nI'll check.\n<tool_call>\n"
        "{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"verbose\": true}}\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22C\n</tool_response>"
        "<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"),
}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_family_template_matches_official_rendering(tokenizer, family):
  fmt = tk.ChatFormat(family, tokenizer, tools=[_WEATHER_TOOL])
  assert fmt.render_messages(_WEATHER_MESSAGES, add_generation_prompt=True) == GOLDEN[family]


@pytest.mark.parametrize("family,thinking", FAMILY_MODES)
@pytest.mark.parametrize("index", range(len(ACTIONS)))
def test_render_action_equals_template_assistant_turn(tokenizer, family, thinking, index):
  fmt = _format(tokenizer, family, thinking)
  history = _context() + [{"role": "assistant", "action": ACTIONS[index]},
                          {"role": "tool", "content": "done"}]
  rendered = fmt.render_messages(history, add_generation_prompt=False)
  prompt = fmt.render_messages(_context(), add_generation_prompt=True)
  turn = fmt.render_action(ACTIONS[index]) + f"{tk.IM_END}\n"
  if (family, thinking) == ("qwen3", False):
    prompt = prompt.removesuffix(f"{tk.THINK_OPEN}\n\n{tk.THINK_CLOSE}\n\n")  # template drops it
  assert rendered.startswith(prompt + turn)


# --- tool-call round trips and malformed output ----------------------------------------------

@pytest.mark.parametrize("family,thinking", FAMILY_MODES)
@pytest.mark.parametrize("index", range(len(ACTIONS)))
def test_render_parse_round_trip(tokenizer, family, thinking, index):
  fmt = _format(tokenizer, family, thinking)
  action = ACTIONS[index]
  parsed = fmt.parse_actions(fmt.render_action(action))
  assert parsed.ok, parsed.error
  assert parsed.actions == (_expected_action(action),)
  # Through token ids too, as a rollout sees it (the stop token is cut off by the parser).
  parsed_ids = fmt.parse_actions(fmt.decode(fmt.encode_action(action)))
  assert parsed_ids.actions == (_expected_action(action),)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_parse_two_calls_in_one_turn(tokenizer, family):
  fmt = _format(tokenizer, family, False)
  first, second = ACTIONS[3], ACTIONS[1]
  text = fmt.render_action(first) + "\n" + fmt.render_action({**second, "thought": ""})
  parsed = fmt.parse_actions(text)
  assert parsed.ok, parsed.error
  assert parsed.actions == (_expected_action(first), _expected_action(second))


def _xml_call(body):
  return f"<tool_call>\n<function=execute_code>\n{body}</function>\n</tool_call>"


def _xml_param(name, value):
  return f"<parameter={name}>\n{value}\n</parameter>\n"


_OK_XML = _xml_param("language", "python") + _xml_param("code", "print(1)")
MALFORMED = {
    "qwen3_5": [
        ("<tool_call>\n<function=execute_code>\n<parameter=language>\npython\n</parameter>\n",
         "unclosed <function=execute_code>"),
        ("<tool_call>\n<function=execute_code>\n<parameter=code>\nprint(1)\n",
         "unclosed <parameter=code>"),
        ("<tool_call>\nexecute_code(code='x')\n</tool_call>", "expected <function=NAME>"),
        (_xml_call(_OK_XML).replace("execute_code", "run_shell"), "unknown function 'run_shell'"),
        (_xml_call(_xml_param("language", "python")), "missing required parameter(s) ['code']"),
        (_xml_call(_xml_param("language", "ruby") + _xml_param("code", "1")),
         "must be one of ['python', 'bash']"),
        (_xml_call(_OK_XML + _xml_param("timeout", "5")), "unexpected parameter 'timeout'"),
        (_xml_call(_OK_XML + _xml_param("code", "2")), "'code' of execute_code is given twice"),
        (_xml_call(_OK_XML) + "\nDone, that should work.", "unexpected text after </tool_call>"),
        ("<function=execute_code>\n" + _OK_XML + "</function>", "outside a <tool_call> block"),
    ],
    "qwen3": [
        ('<tool_call>\n{"name": "execute_code", "arguments": {"language": "python", "code": "x"',
         "not valid JSON"),
        ('<tool_call>\n{"name": "execute_code", "arguments": {"language": "python", "code": "x"}}',
         "unclosed <tool_call>"),
        ("<tool_call>\n{name: execute_code}\n</tool_call>", "not valid JSON"),
        ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', "unknown function 'rm'"),
        ('<tool_call>\n{"name": "execute_code", "arguments": {"language": "bash"}}\n</tool_call>',
         "missing required parameter(s) ['code']"),
        ('<tool_call>\n{"name": "execute_code", "arguments": {"language": "python", "code": 42}}'
         "\n</tool_call>", "expected string, got int"),
        ('<tool_call>\n{"name": "execute_code", "arguments": "{}"}\n</tool_call>',
         "must be a JSON object"),
        ('<tool_call>\n["execute_code"]\n</tool_call>', 'keys "name" and "arguments"'),
        ("</tool_call>", "outside a <tool_call> block"),
    ],
}


@pytest.mark.parametrize("family,text,message",
                         [(f, t, m) for f, cases in MALFORMED.items() for t, m in cases])
def test_malformed_turn_is_a_parse_error_value(tokenizer, family, text, message):
  parsed = _format(tokenizer, family, False).parse_actions(text + tk.IM_END)
  assert not parsed.ok and parsed.actions == ()
  assert isinstance(parsed.error, tk.ParseError)
  assert message in parsed.error.message


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_over_long_and_unclosed_think_are_parse_errors(tokenizer, family):
  fmt = tk.ChatFormat(family, tokenizer, max_turn_chars=200)
  long_action = {"name": "execute_code", "arguments": {"language": "python", "code": "x" * 300}}
  parsed = fmt.parse_actions(fmt.render_action(long_action))
  assert "over the 200-character limit" in parsed.error.message
  text = ("" if family == "qwen3_5" else tk.THINK_OPEN) + "I keep thinking and never stop"
  assert "unclosed <think>" in fmt.parse_actions(text).error.message


def test_turn_without_tool_call_is_not_an_error(tokenizer):
  parsed = _format(tokenizer, "qwen3_5", False).parse_actions("All stages are done.<|im_end|>")
  assert parsed.ok and parsed.actions == () and parsed.thought == "All stages are done."


_FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=execute_code>", "</function>",
              "<parameter=code>", "<parameter=language>", "</parameter>", "\n", "python", "{",
              '"name"', ":", "}", '"arguments"', "<think>", "</think>", "<|im_end|>", " x "]


@hypothesis.settings(max_examples=100, deadline=None, derandomize=True)
@hypothesis.given(parts=st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=8)),
                                 max_size=30),
                  family=st.sampled_from(["qwen3", "qwen3_5"]), thinking=st.booleans())
def test_parse_never_raises(tokenizer, parts, family, thinking):
  parsed = _format(tokenizer, family, thinking).parse_actions("".join(parts))
  assert isinstance(parsed, tk.ParsedTurn)
  assert parsed.ok or (parsed.actions == () and parsed.error.message)


def test_render_action_rejects_bad_actions(tokenizer):
  fmt = _format(tokenizer, "qwen3_5", True)
  with pytest.raises(ValueError, match="'arguments'"):
    fmt.render_action({"name": "execute_code", "arguments": "print(1)"})
  with pytest.raises(ValueError, match="'arguments.code'"):
    fmt.render_action({"name": "execute_code",
                       "arguments": {"language": "python", "code": "x<|im_end|>"}})


# --- token-level deltas and SFT masks ----------------------------------------------------------

@pytest.mark.parametrize("family,thinking", PREFIX_STABLE_MODES)
def test_prompt_turns_and_deltas_equal_template_tokens(tokenizer, family, thinking):
  fmt = _format(tokenizer, family, thinking)
  messages = _context()
  ids = fmt.encode_prompt(messages)
  for action, observation in zip(ACTIONS, OBSERVATIONS + [OBSERVATIONS[:2]]):
    if (family, thinking) == ("qwen3_5", True) and not action["thought"]:
      # An empty think block: the prompt ends "<think>\n" and the turn starts "\n</think>", which
      # the template's text tokenises as one "\n\n" token. The text still matches exactly.
      assert fmt.decode(fmt.encode_action(action)).startswith("\n" + tk.THINK_CLOSE)
      continue
    ids += fmt.encode_action(action) + fmt.encode_observation_delta(observation)
    observations = [observation] if isinstance(observation, str) else observation
    messages = messages + [{"role": "assistant", "action": action}] + [
        {"role": "tool", "content": o} for o in observations]
    assert ids == fmt.encode_prompt(messages)
    assert fmt.decode(ids) == fmt.render_messages(messages, add_generation_prompt=True)


@pytest.mark.parametrize("family,thinking", FAMILY_MODES)
def test_delta_is_the_template_suffix_of_the_tool_message(tokenizer, family, thinking):
  fmt = _format(tokenizer, family, thinking)
  history = _context() + [{"role": "assistant", "action": ACTIONS[0]},
                          {"role": "tool", "content": OBSERVATIONS[1]}]
  rendered = fmt.render_messages(history, add_generation_prompt=True)
  turn_end = rendered.rindex(tk.CALL_CLOSE + tk.IM_END) + len(tk.CALL_CLOSE + tk.IM_END)
  assert fmt.encode_observation_delta(OBSERVATIONS[1]) == fmt.encode(rendered[turn_end:])
  assert fmt.encode_observation_delta(OBSERVATIONS[1], after_stop=False)[0] == fmt.im_end_id


@pytest.mark.parametrize("family,thinking", FAMILY_MODES)
def test_sft_example_masks_only_the_target_action(tokenizer, family, thinking):
  fmt = _format(tokenizer, family, thinking)
  history = _context() + [{"role": "assistant", "action": ACTIONS[0]},
                          {"role": "tool", "content": OBSERVATIONS[0]}]
  target = ACTIONS[3]
  ids, mask = fmt.encode_sft_example(history, target)
  target_ids = fmt.encode_action(target)
  assert len(ids) == len(mask) and set(mask) == {0, 1}
  assert mask == [0] * (len(ids) - len(target_ids)) + [1] * len(target_ids)
  assert ids[-len(target_ids):] == target_ids and ids[-1] == fmt.im_end_id
  context = (fmt.encode_prompt(_context()) + fmt.encode_action(ACTIONS[0])
             + fmt.encode_observation_delta(OBSERVATIONS[0]))
  assert ids[:len(context)] == context and len(context) == len(ids) - len(target_ids)
  if (family, thinking) in PREFIX_STABLE_MODES:
    assert ids[:len(context)] == fmt.encode_prompt(history)
  parsed = fmt.parse_actions(fmt.decode([i for i, m in zip(ids, mask) if m]))
  assert parsed.actions == (_expected_action(target),)


def test_sft_example_rejects_unsupported_history(tokenizer):
  fmt = _format(tokenizer, "qwen3_5", True)
  history = _context() + [{"role": "assistant", "action": ACTIONS[0]},
                          {"role": "user", "content": "and now?"}]
  with pytest.raises(ValueError, match=r"messages\[3\]"):
    fmt.encode_sft_example(history, ACTIONS[1])
  back_to_back = _context() + [{"role": "assistant", "action": ACTIONS[0]},
                               {"role": "assistant", "action": ACTIONS[1]}]
  with pytest.raises(ValueError, match=r"messages\[3\]"):
    fmt.encode_sft_example(back_to_back, ACTIONS[2])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_adversarial_turns_give_bounded_parse_errors(tokenizer, family):
  fmt = _format(tokenizer, family, False)
  call = fmt.render_action({**ACTIONS[0], "thought": ""})
  parsed = fmt.parse_actions((call + "\n") * 30 + "junk")
  assert "unexpected text after </tool_call>: 'junk'" in parsed.error.message
  parsed = fmt.parse_actions((call + "\n") * 70)
  assert "more than 64 tool calls" in parsed.error.message
  many = "<tool_call>\n<function=execute_code>\n" + "<parameter=a>\n1\n</parameter>\n" * 100
  assert not fmt.parse_actions(many).ok


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_non_string_parameters_round_trip_and_are_type_checked(tokenizer, family):
  fmt = tk.ChatFormat(family, tokenizer, tools=[_WEATHER_TOOL], enable_thinking=False)
  action = {"name": "get_weather", "arguments": {"location": "Paris", "verbose": True},
            "thought": "I'll check."}
  assert fmt.parse_actions(fmt.render_action(action)).actions == (action,)
  bad = fmt.render_action({**action, "arguments": {"location": "Paris", "verbose": "maybe"}})
  message = fmt.parse_actions(bad).error.message
  assert "parameter 'verbose' of get_weather: expected boolean" in message
