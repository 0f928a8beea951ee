"""An exported policy folder records the chat format it was trained with, and the server
(`load_served_model`, what `python -m bat_jax.serve --model-path runs/X/policies/NAME` runs)
renders prompts with it: a compact-preamble policy is not served Qwen's full tool block."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from bat_jax import workflow
from bat_jax.checkpointing import export_hf
from bat_jax.model import compact_chat
from bat_jax.rollout import server as serve
from serve_fixtures import ENGINE

MESSAGES = [{"role": "system", "content": "You are the agent."},
            {"role": "user", "content": "Plan the task."}]


@pytest.mark.parametrize("preamble", ["compact", "template"])
def test_served_prompt_is_the_training_prompt(preamble, model, tokenizer, tokenizer_dir,
                                              tmp_path):
  run_tokenizer = tmp_path / "tokenizer"
  shutil.copytree(tokenizer_dir, run_tokenizer)
  compact_chat.record_chat_format(run_tokenizer, preamble)   # what prepare_tokenizer does
  policy = export_hf(model, tmp_path / "runs" / "x" / "policies" / "sft",
                     tokenizer_dir=run_tokenizer)
  config = json.loads((policy / "tokenizer_config.json").read_text())
  assert config[compact_chat.CHAT_FORMAT_FIELD] == {"tool_preamble": preamble}
  served = serve.load_served_model(str(policy), ENGINE)
  trained = compact_chat.chat_format_for(preamble, "qwen3_5_text", tokenizer)
  assert type(served.chat_format) is type(trained)
  tools = [workflow.TOOL_SCHEMA]
  expected = trained.encode_prompt(MESSAGES, tools)
  full = compact_chat.chat_format_for("template", "qwen3_5_text", tokenizer).encode_prompt(
      MESSAGES, tools)
  assert (len(expected) < len(full)) == (preamble == "compact")
  app = serve.ServeApp(served)
  httpd, base = serve.serve_in_thread(app)
  try:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    out = client.chat.completions.create(model="sft", messages=MESSAGES, tools=tools,
                                         max_tokens=1)
    assert out.usage.prompt_tokens == len(expected)
  finally:
    httpd.shutdown()
    httpd.server_close()
    app.close()


def test_a_folder_without_a_record_is_served_the_template_and_junk_is_refused(tmp_path,
                                                                            tokenizer_dir):
  assert compact_chat.recorded_preamble(tokenizer_dir) == "template"
  shutil.copytree(tokenizer_dir, tmp_path / "tok")
  path = tmp_path / "tok" / "tokenizer_config.json"
  config = json.loads(path.read_text())
  config[compact_chat.CHAT_FORMAT_FIELD] = {"tool_preamble": "tiny"}
  path.write_text(json.dumps(config))
  with pytest.raises(ValueError, match="bat_jax_chat_format.tool_preamble = 'tiny'"):
    compact_chat.recorded_preamble(tmp_path / "tok")
