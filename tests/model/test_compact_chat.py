"""The compact tool preamble: short prompts, the family's own call syntax, deltas and parsing."""

import pytest

from bat_jax import workflow
from bat_jax.model import compact_chat
from bat_jax.model import chat_format
from bat_jax.model import tokenizer as tk

ACTION = {"name": workflow.TOOL_NAME, "thought": "Plan from the task facts.",
          "arguments": {"language": "bash",
                        "code": "python tools/plan.py --weights w_r3.json --data data/s_9"}}
MESSAGES = [{"role": "system", "content": workflow.SYSTEM_PROMPT},
            {"role": "user", "content": "Track: vqa. Facts: data: data/s_9; cases: 4."}]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_compact_prompt_is_short_and_names_the_tool(tokenizer, model_type):
  full = chat_format.ChatFormat.for_model(model_type, tokenizer)
  compact = compact_chat.chat_format_for("compact", model_type, tokenizer)
  text = compact.render_messages(MESSAGES, add_generation_prompt=True)
  assert "<tools>" not in text and "IMPORTANT" not in text
  assert "execute_code(language: python|bash, code)" in text
  assert workflow.SYSTEM_PROMPT in text and MESSAGES[1]["content"] in text
  assert text.count(tk.IM_START + "system") == 1
  assert 10 * len(compact.encode_prompt(MESSAGES)) < 7 * len(full.encode_prompt(MESSAGES))
  # The assistant side is the family's: same action tokens, same generation prompt.
  assert compact.encode_action(ACTION) == full.encode_action(ACTION)
  assert text.endswith(full.generation_prompt)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_compact_sft_example_is_a_rollout_stream_and_parses(tokenizer, model_type):
  chat = compact_chat.chat_format_for("compact", model_type, tokenizer)
  obs = workflow.format_observation(0, "plan/plan.md written\n", "")
  history = MESSAGES + [{"role": "assistant", "action": ACTION},
                        {"role": "tool", "content": obs}]
  ids, mask = chat.encode_sft_example(history, ACTION)
  stream = (chat.encode_prompt(MESSAGES) + chat.encode_action(ACTION)
            + chat.encode_observation_delta(obs) + chat.encode_action(ACTION))
  assert ids == stream
  assert sum(mask) == len(chat.encode_action(ACTION)) and mask[-1] == 1
  turn = chat.parse_actions(chat.render_action(ACTION))
  assert turn.ok and turn.actions[0]["arguments"] == ACTION["arguments"]
  bad = chat.parse_actions(chat.render_action(dict(ACTION, name="rm_rf")))
  assert not bad.ok and "rm_rf" in bad.error.message  # still validated against the tools


def test_compact_without_system_message_inserts_one(tokenizer):
  chat = compact_chat.chat_format_for("compact", "qwen3_5_text", tokenizer)
  text = chat.render_messages(MESSAGES[1:], add_generation_prompt=True)
  assert text.startswith(tk.IM_START + "system\nTool execute_code(")


def test_unknown_preamble_names_the_field(tokenizer):
  with pytest.raises(ValueError, match="tokenizer.tool_preamble"):
    compact_chat.chat_format_for("short", "qwen3_5_text", tokenizer)
