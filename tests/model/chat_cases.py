"""Actions, observations and helpers shared by the chat-format and tool-parser tests."""

from bat_jax import workflow
from bat_jax.model import chat_format

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
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"},
                                         "verbose": {"type": "boolean"}},
        "required": ["location"]}}}


def make_format(tokenizer, family, thinking):
  return chat_format.ChatFormat(family, tokenizer, enable_thinking=thinking)


def context():
  return [{"role": "system", "content": "Complete the workflow using observable evidence."},
          {"role": "user", "content": "Inspect the files and run a small validation."}]


def expected_action(action):
  return {**action, "thought": action["thought"].strip()}
