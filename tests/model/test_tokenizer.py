"""Tokenizer training and loading."""

import json
import shutil

import pytest
import transformers

import chat_cases
from bat_jax.model import tokenizer as tk


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
  rendered = tok.apply_chat_template(chat_cases.context(), tokenize=False,
                                     add_generation_prompt=True)
  assert rendered.endswith(f"{tk.IM_START}assistant\n{tk.THINK_OPEN}\n")


def test_reserved_tokens_are_special_and_leave_other_vocabularies_alone(tokenizer_dir, tmp_path):
  from bat_jax.model import tokenizer_corpus
  docs = tokenizer_corpus.tiny_corpus()
  plain = tk.train_tokenizer(docs, 1024, tmp_path / "plain")
  assert (plain / "tokenizer.json").read_text() == (tokenizer_dir / "tokenizer.json").read_text()
  tok = tk.load_tokenizer(tk.train_tokenizer(docs, 1024, tmp_path / "r",
                                             reserved=tk.PRETRAIN_TOKENS))
  assert len(tok) == 1024   # counted in vocab_size
  ids = [tok.convert_tokens_to_ids(t) for t in tk.PRETRAIN_TOKENS]
  assert set(ids) <= set(tok.all_special_ids)
  text = f"a{tk.ECHO_LIST}b{tk.ECHO_COPY}c"
  assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True) == "abc"


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
