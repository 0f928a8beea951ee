"""Chat templates, rendering, observation deltas and SFT masks of the chat format."""

import pytest
import tokenizers
import transformers

import chat_cases
from bat_jax.model import chat_format
from bat_jax.model import tokenizer as tk


def test_chat_format_rejects_unknown_model_type_and_incomplete_tokenizer(tokenizer):
  with pytest.raises(ValueError, match="llama"):
    chat_format.ChatFormat.for_model("llama", tokenizer)
  assert chat_format.ChatFormat.for_model("qwen3_5_text", tokenizer).family == "qwen3_5"
  raw = tokenizers.Tokenizer(tokenizers.models.BPE())
  raw.add_special_tokens([tk.IM_START, tk.IM_END])
  bare = transformers.PreTrainedTokenizerFast(tokenizer_object=raw)
  with pytest.raises(ValueError, match=r"<\|endoftext\|>"):
    chat_format.ChatFormat("qwen3", bare)
  fmt = chat_format.ChatFormat.for_model("qwen3", tokenizer)
  assert fmt.stop_token_ids == (tokenizer.convert_tokens_to_ids(tk.IM_END),
                                tokenizer.convert_tokens_to_ids(tk.ENDOFTEXT))


# --- templates -------------------------------------------------------------------------------

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
  fmt = chat_format.ChatFormat(family, tokenizer, tools=[chat_cases.WEATHER_TOOL])
  assert fmt.render_messages(_WEATHER_MESSAGES, add_generation_prompt=True) == GOLDEN[family]


@pytest.mark.parametrize("family,thinking", chat_cases.FAMILY_MODES)
@pytest.mark.parametrize("index", range(len(chat_cases.ACTIONS)))
def test_render_action_equals_template_assistant_turn(tokenizer, family, thinking, index):
  fmt = chat_cases.make_format(tokenizer, family, thinking)
  history = chat_cases.context() + [{"role": "assistant", "action": chat_cases.ACTIONS[index]},
                          {"role": "tool", "content": "done"}]
  rendered = fmt.render_messages(history, add_generation_prompt=False)
  prompt = fmt.render_messages(chat_cases.context(), add_generation_prompt=True)
  turn = fmt.render_action(chat_cases.ACTIONS[index]) + f"{tk.IM_END}\n"
  if (family, thinking) == ("qwen3", False):
    prompt = prompt.removesuffix(f"{tk.THINK_OPEN}\n\n{tk.THINK_CLOSE}\n\n")  # template drops it
  assert rendered.startswith(prompt + turn)


def test_render_action_rejects_bad_actions(tokenizer):
  fmt = chat_cases.make_format(tokenizer, "qwen3_5", True)
  with pytest.raises(ValueError, match="'arguments'"):
    fmt.render_action({"name": "execute_code", "arguments": "print(1)"})
  with pytest.raises(ValueError, match="'arguments.code'"):
    fmt.render_action({"name": "execute_code",
                       "arguments": {"language": "python", "code": "x<|im_end|>"}})


# --- token-level deltas and SFT masks ----------------------------------------------------------

@pytest.mark.parametrize("family,thinking", chat_cases.PREFIX_STABLE_MODES)
def test_prompt_turns_and_deltas_equal_template_tokens(tokenizer, family, thinking):
  fmt = chat_cases.make_format(tokenizer, family, thinking)
  messages = chat_cases.context()
  ids = fmt.encode_prompt(messages)
  observations = chat_cases.OBSERVATIONS + [chat_cases.OBSERVATIONS[:2]]
  for action, observation in zip(chat_cases.ACTIONS, observations):
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


@pytest.mark.parametrize("family,thinking", chat_cases.FAMILY_MODES)
def test_delta_is_the_template_suffix_of_the_tool_message(tokenizer, family, thinking):
  fmt = chat_cases.make_format(tokenizer, family, thinking)
  history = chat_cases.context() + [{"role": "assistant", "action": chat_cases.ACTIONS[0]},
                          {"role": "tool", "content": chat_cases.OBSERVATIONS[1]}]
  rendered = fmt.render_messages(history, add_generation_prompt=True)
  turn_end = rendered.rindex(tk.CALL_CLOSE + tk.IM_END) + len(tk.CALL_CLOSE + tk.IM_END)
  assert fmt.encode_observation_delta(chat_cases.OBSERVATIONS[1]) == fmt.encode(rendered[turn_end:])
  delta = fmt.encode_observation_delta(chat_cases.OBSERVATIONS[1], after_stop=False)
  assert delta[0] == fmt.im_end_id


@pytest.mark.parametrize("family,thinking", chat_cases.FAMILY_MODES)
def test_sft_example_masks_only_the_target_action(tokenizer, family, thinking):
  fmt = chat_cases.make_format(tokenizer, family, thinking)
  history = chat_cases.context() + [{"role": "assistant", "action": chat_cases.ACTIONS[0]},
                          {"role": "tool", "content": chat_cases.OBSERVATIONS[0]}]
  target = chat_cases.ACTIONS[3]
  ids, mask = fmt.encode_sft_example(history, target)
  target_ids = fmt.encode_action(target)
  assert len(ids) == len(mask) and set(mask) == {0, 1}
  assert mask == [0] * (len(ids) - len(target_ids)) + [1] * len(target_ids)
  assert ids[-len(target_ids):] == target_ids and ids[-1] == fmt.im_end_id
  context = (fmt.encode_prompt(chat_cases.context()) + fmt.encode_action(chat_cases.ACTIONS[0])
             + fmt.encode_observation_delta(chat_cases.OBSERVATIONS[0]))
  assert ids[:len(context)] == context and len(context) == len(ids) - len(target_ids)
  if (family, thinking) in chat_cases.PREFIX_STABLE_MODES:
    assert ids[:len(context)] == fmt.encode_prompt(history)
  parsed = fmt.parse_actions(fmt.decode([i for i, m in zip(ids, mask) if m]))
  assert parsed.actions == (chat_cases.expected_action(target),)


def test_sft_example_rejects_unsupported_history(tokenizer):
  fmt = chat_cases.make_format(tokenizer, "qwen3_5", True)
  history = chat_cases.context() + [{"role": "assistant", "action": chat_cases.ACTIONS[0]},
                          {"role": "user", "content": "and now?"}]
  with pytest.raises(ValueError, match=r"messages\[3\]"):
    fmt.encode_sft_example(history, chat_cases.ACTIONS[1])
  back_to_back = chat_cases.context() + [{"role": "assistant", "action": chat_cases.ACTIONS[0]},
                               {"role": "assistant", "action": chat_cases.ACTIONS[1]}]
  with pytest.raises(ValueError, match=r"messages\[3\]"):
    fmt.encode_sft_example(back_to_back, chat_cases.ACTIONS[2])



FINAL = {"thought": "Every call has run.", "final": "Done."}


# Qwen3 without thinking is left out: its template writes an empty think block before a last
# assistant message that has no tool call, which the policy never generates (a final turn ends
# the episode, so it is never rendered back into a prompt).
@pytest.mark.parametrize("family,thinking", [m for m in chat_cases.FAMILY_MODES
                                             if m != ("qwen3", False)])
def test_final_turn_equals_template_turn_and_parses_as_a_stop(tokenizer, family, thinking):
  """A final action (`{thought, final}`: no tool call) renders as the template writes an
  assistant message without tool calls, and parses back as a turn with no action (the agent
  loop's `agent_stop`)."""
  fmt = chat_cases.make_format(tokenizer, family, thinking)
  message = {"role": "assistant", "content": FINAL["final"]}
  if thinking:
    message["reasoning_content"] = FINAL["thought"]
  else:
    message["content"] = f"{FINAL['thought']}\n\n{FINAL['final']}"
  rendered = fmt.render_messages(chat_cases.context() + [message], add_generation_prompt=False)
  prompt = fmt.render_messages(chat_cases.context(), add_generation_prompt=True)
  turn = fmt.render_action(FINAL)
  assert rendered.startswith(prompt + turn + tk.IM_END)
  parsed = fmt.parse_actions(turn)
  assert parsed.ok and parsed.actions == ()
  ids, mask = fmt.encode_sft_example(chat_cases.context(), FINAL)
  assert fmt.decode([i for i, m in zip(ids, mask) if m]) == turn + tk.IM_END


def test_final_turn_rejects_a_tool_call_or_an_empty_text(tokenizer):
  fmt = chat_cases.make_format(tokenizer, "qwen3_5", True)
  with pytest.raises(ValueError, match="no tool call"):
    fmt.render_action({**FINAL, "name": "execute_code"})
  with pytest.raises(ValueError, match="non-empty 'final'"):
    fmt.render_action({"thought": "x", "final": " "})
  with pytest.raises(ValueError, match="break the turn"):
    fmt.render_action({"thought": "x", "final": "Done.<tool_call>"})
