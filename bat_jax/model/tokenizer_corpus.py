"""A small deterministic training corpus for tiny tokenizers (no download needed)."""

from __future__ import annotations

import json
import random

from bat_jax import workflow
from bat_jax.model.tokenizer import (CALL_CLOSE, CALL_OPEN, IM_END, IM_START, RESPONSE_CLOSE,
                                     RESPONSE_OPEN)

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

