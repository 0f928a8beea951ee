"""Reading tool calls back out of generated turns: round trips, malformed and adversarial text."""

import hypothesis
from hypothesis import strategies as st
import pytest

import chat_cases
from bat_jax.model import chat_format
from bat_jax.model import tokenizer as tk
from bat_jax.model import tool_parser


@pytest.mark.parametrize("family,thinking", chat_cases.FAMILY_MODES)
@pytest.mark.parametrize("index", range(len(chat_cases.ACTIONS)))
def test_render_parse_round_trip(tokenizer, family, thinking, index):
  fmt = chat_cases.make_format(tokenizer, family, thinking)
  action = chat_cases.ACTIONS[index]
  parsed = fmt.parse_actions(fmt.render_action(action))
  assert parsed.ok, parsed.error
  assert parsed.actions == (chat_cases.expected_action(action),)
  # Through token ids too, as a rollout sees it (the stop token is cut off by the parser).
  parsed_ids = fmt.parse_actions(fmt.decode(fmt.encode_action(action)))
  assert parsed_ids.actions == (chat_cases.expected_action(action),)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_parse_two_calls_in_one_turn(tokenizer, family):
  fmt = chat_cases.make_format(tokenizer, family, False)
  first, second = chat_cases.ACTIONS[3], chat_cases.ACTIONS[1]
  text = fmt.render_action(first) + "\n" + fmt.render_action({**second, "thought": ""})
  parsed = fmt.parse_actions(text)
  assert parsed.ok, parsed.error
  assert parsed.actions == (chat_cases.expected_action(first), chat_cases.expected_action(second))


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
  parsed = chat_cases.make_format(tokenizer, family, False).parse_actions(text + tk.IM_END)
  assert not parsed.ok and parsed.actions == ()
  assert isinstance(parsed.error, tool_parser.ParseError)
  assert message in parsed.error.message


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_over_long_and_unclosed_think_are_parse_errors(tokenizer, family):
  fmt = chat_format.ChatFormat(family, tokenizer, max_turn_chars=200)
  long_action = {"name": "execute_code", "arguments": {"language": "python", "code": "x" * 300}}
  parsed = fmt.parse_actions(fmt.render_action(long_action))
  assert "over the 200-character limit" in parsed.error.message
  text = ("" if family == "qwen3_5" else tk.THINK_OPEN) + "I keep thinking and never stop"
  assert "unclosed <think>" in fmt.parse_actions(text).error.message


def test_turn_without_tool_call_is_not_an_error(tokenizer):
  fmt = chat_cases.make_format(tokenizer, "qwen3_5", False)
  parsed = fmt.parse_actions("All stages are done.<|im_end|>")
  assert parsed.ok and parsed.actions == () and parsed.thought == "All stages are done."


_FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=execute_code>", "</function>",
              "<parameter=code>", "<parameter=language>", "</parameter>", "\n", "python", "{",
              '"name"', ":", "}", '"arguments"', "<think>", "</think>", "<|im_end|>", " x "]


@hypothesis.settings(max_examples=100, deadline=None, derandomize=True)
@hypothesis.given(parts=st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=8)),
                                 max_size=30),
                  family=st.sampled_from(["qwen3", "qwen3_5"]), thinking=st.booleans())
def test_parse_never_raises(tokenizer, parts, family, thinking):
  parsed = chat_cases.make_format(tokenizer, family, thinking).parse_actions("".join(parts))
  assert isinstance(parsed, tool_parser.ParsedTurn)
  assert parsed.ok or (parsed.actions == () and parsed.error.message)

@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_adversarial_turns_give_bounded_parse_errors(tokenizer, family):
  fmt = chat_cases.make_format(tokenizer, family, False)
  call = fmt.render_action({**chat_cases.ACTIONS[0], "thought": ""})
  parsed = fmt.parse_actions((call + "\n") * 30 + "junk")
  assert "unexpected text after </tool_call>: 'junk'" in parsed.error.message
  parsed = fmt.parse_actions((call + "\n") * 70)
  assert "more than 64 tool calls" in parsed.error.message
  many = "<tool_call>\n<function=execute_code>\n" + "<parameter=a>\n1\n</parameter>\n" * 100
  assert not fmt.parse_actions(many).ok


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_non_string_parameters_round_trip_and_are_type_checked(tokenizer, family):
  fmt = chat_format.ChatFormat(family, tokenizer, tools=[chat_cases.WEATHER_TOOL],
                               enable_thinking=False)
  action = {"name": "get_weather", "arguments": {"location": "Paris", "verbose": True},
            "thought": "I'll check."}
  assert fmt.parse_actions(fmt.render_action(action)).actions == (action,)
  bad = fmt.render_action({**action, "arguments": {"location": "Paris", "verbose": "maybe"}})
  message = fmt.parse_actions(bad).error.message
  assert "parameter 'verbose' of get_weather: expected boolean" in message


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("token", [tk.CALL_OPEN, tk.IM_START])
def test_reasoning_that_could_not_render_back_is_a_parse_error(tokenizer, family, token):
  # Seen in a tiny run: a `<tool_call>` inside the reasoning parsed into an action that the next
  # prompt's renderer refused, crashing the held-out cell. It must be a malformed turn instead.
  fmt = chat_cases.make_format(tokenizer, family, True)
  action = {"name": "execute_code", "thought": "look first",
            "arguments": {"language": "bash", "code": "ls"}}
  text = fmt.render_action(action).replace("look first", f"look {token} first", 1)
  parsed = fmt.parse_actions(text)
  assert not parsed.ok and parsed.actions == ()
  assert f"contains {token!r}" in parsed.error.message
  fmt.render_messages([{"role": "user", "content": "go"},   # what the episode appends instead
                       {"role": "assistant", "content": "x"}], (), add_generation_prompt=True)
