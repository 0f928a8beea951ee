"""The Qwen3 / Qwen3.5 byte-level BPE tokenizer: its special tokens, training and loading.

The vocabulary carries Qwen's control tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`) and
the markup tokens of the chat format (tool-call, tool-response and think tags); the family's chat
template (`chat_templates/*.jinja`) is written into `tokenizer_config.json`. Everything reads local
directories only; nothing touches the hub. The chat format itself is `chat_format.ChatFormat`;
the tool-call parser is `tool_parser.ToolParser`.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable, Mapping, Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
import transformers

from bat_jax import io_utils

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# Control tokens are `special` (dropped by skip_special_tokens); markup tokens are not, as in Qwen,
# so decoded text (e.g. an SGLang response) keeps the tool-call and think tags.
CONTROL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
MARKUP_TOKENS: tuple[str, ...] = (
    CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, THINK_OPEN, THINK_CLOSE)
# Reserved for the tiny base's echo pretraining (`bat_jax.pretrain.base`): one separator per role,
# a token no text and no echo list ever contains (the chat format's own tokens would teach it
# something about turns). Only tokenizers trained with `reserved=PRETRAIN_TOKENS` hold them.
ECHO_LIST, ECHO_COPY = "<|echo_list|>", "<|echo_copy|>"
PRETRAIN_TOKENS: tuple[str, ...] = (ECHO_LIST, ECHO_COPY)
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")
# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation, newlines.
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# model_type (config.json) -> chat family (template file, tool-call syntax).
FAMILY_OF_MODEL_TYPE: Mapping[str, str] = {
    "qwen3": "qwen3", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"}
TEMPLATE_DIR = pathlib.Path(__file__).with_name("chat_templates")


def chat_template(family: str) -> str:
  """The Jinja chat template of a chat family (`qwen3` or `qwen3_5`)."""
  path = TEMPLATE_DIR / f"{family}.jinja"
  if not path.is_file():
    raise ValueError(f"unknown chat family {family!r}; expected one of "
                     f"{sorted(set(FAMILY_OF_MODEL_TYPE.values()))}")
  return path.read_text(encoding="utf-8")


def train_tokenizer(corpus: Iterable[str], vocab_size: int, out_dir: str | os.PathLike, *,
                    chat_family: str = "qwen3_5", min_frequency: int = 2,
                    reserved: Sequence[str] = ()) -> pathlib.Path:
  """Trains a byte-level BPE tokenizer in HF format with Qwen's special tokens and chat template.

  Args:
    corpus: training texts.
    vocab_size: total vocabulary size, special tokens included. A small corpus may yield fewer
      merges; `len(load_tokenizer(out_dir))` is the real size (never above `vocab_size`).
    out_dir: directory to write `tokenizer.json`, `tokenizer_config.json` and
      `special_tokens_map.json` into (created if missing).
    chat_family: whose chat template goes into `tokenizer_config.json` (`qwen3_5` or `qwen3`).
    min_frequency: minimum pair count for a merge.
    reserved: extra special tokens (e.g. `PRETRAIN_TOKENS`), counted in `vocab_size`.

  Returns:
    `out_dir` as a Path; loadable by `load_tokenizer`, `AutoTokenizer` and SGLang.
  """
  template = chat_template(chat_family)
  control = CONTROL_TOKENS + tuple(reserved)
  floor = 256 + len(control) + len(MARKUP_TOKENS)
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
      special_tokens=list(control), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  tok.train_from_iterator(corpus, trainer)
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                  for t in MARKUP_TOKENS])

  added = {str(tok.token_to_id(t)): {
      "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
      "special": t in control} for t in control + MARKUP_TOKENS}
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "added_tokens_decoder": added,
      "bos_token": None, "eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": None,
      "additional_special_tokens": [IM_START, IM_END, *reserved],
      "clean_up_tokenization_spaces": False, "split_special_tokens": False,
      "model_max_length": 131072, "errors": "replace",
      "chat_template": template,
  }
  special_map = {"eos_token": IM_END, "pad_token": ENDOFTEXT,
                 "additional_special_tokens": [IM_START, IM_END, *reserved]}
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
