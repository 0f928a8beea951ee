"""lm-evaluation-harness (pinned in requirements-dev.txt) in-process against `/v1/completions`:
its `local-completions` model runs a loglikelihood (multiple-choice) and a generate_until task
defined in lm_eval_tasks/ over a 3-row local file; nothing is downloaded. Each of its answers is
checked against the server asked directly."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import yaml

TASKS = Path(__file__).with_name("lm_eval_tasks")


def _task(name: str) -> dict:
  config = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
  config["dataset_kwargs"] = {"data_files": {"test": str(TASKS / "tiny.jsonl")}}
  return config


@pytest.mark.slow  # ~1-3 min on 2 busy cores: lm-eval's import, a prompt-scorer compile
def test_lm_eval_local_completions_loglikelihood_and_generate_until(served, tokenizer_dir,
                                                                    tmp_path, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
  lm_eval = pytest.importorskip("lm_eval")
  app, base = served
  out = lm_eval.simple_evaluate(
      model="local-completions",
      model_args={"base_url": f"{base}/v1/completions", "model": "bat-tiny",
                  "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_dir),
                  "num_concurrent": 1, "max_retries": 1, "max_length": 512},
      tasks=[_task("bat_tiny_mc"), _task("bat_tiny_gen")], log_samples=True,
      bootstrap_iters=0)
  mc, gen = out["results"]["bat_tiny_mc"], out["results"]["bat_tiny_gen"]
  client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
  # Loglikelihood: lm-eval's numbers are the server's echo scores of context + continuation,
  # and its accuracy is the share of rows whose best-scored choice is the answer.
  hits, rows = 0, out["samples"]["bat_tiny_mc"]
  for sample in rows:
    scores = []
    for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
      ctx = tokenizer_ids(tokenizer_dir, context)
      full = tokenizer_ids(tokenizer_dir, context + continuation)
      lp = client.completions.create(model="bat-tiny", prompt=full, max_tokens=0, echo=True,
                                     logprobs=1).choices[0].logprobs.token_logprobs
      scores.append(sum(lp[len(ctx):]))
      assert resp[0][0] == pytest.approx(scores[-1], abs=1e-3)
    hits += int(max(range(len(scores)), key=scores.__getitem__) == sample["doc"]["answer"])
  assert mc["acc,none"] == pytest.approx(hits / len(rows))
  # generate_until: lm-eval's answers are the server's greedy completions cut at "\n".
  for sample in out["samples"]["bat_tiny_gen"]:
    direct = client.completions.create(model="bat-tiny", prompt=sample["doc"]["question"],
                                       max_tokens=4, temperature=0, stop=["\n"])
    assert sample["filtered_resps"][0] == direct.choices[0].text
  assert 0.0 <= gen["exact_match,none"] <= 1.0


def tokenizer_ids(tokenizer_dir, text: str) -> list[int]:
  import transformers
  tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
  return tok.encode(text, add_special_tokens=False)
