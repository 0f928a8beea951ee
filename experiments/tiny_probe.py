r"""A quick probe of the tiny cold start: SFT only, then greedy calls scored per stage.

  python experiments/tiny_probe.py --config=configs/tiny.py --workdir=/tmp/probe \
      [--config.sft.steps=300 ...] [--heldout]

Runs the main job's own setup (tokenizer, markers, leak-checked Stage Bank SFT rows) and
cold-start SFT in WORKDIR (reused: a rerun resumes SFT and skips what is built), then greedy-
decodes the target turn of every SFT *validation* row (tasks the policy never trained on; prior
turns and real observations given) and scores it: `format` (a parsed tool call) and `exact` (the
call's code equals the expert's, every argument value copied right), per stage and per action
index. `--heldout` also runs the built-in held-out evaluation of the SFT policy (the same
`evaluate_policy` the main job runs after SFT) and prints its per-stage scores. Each lever of the
tiny world (model width, rows, steps, lr, preamble) costs one probe: minutes, not a main job.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "run config",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "probe directory (created; reused)")
_HELDOUT = flags.DEFINE_bool("heldout", False, "also run the held-out evaluation after SFT")
_REUSE = flags.DEFINE_string("reuse", None, "copy tokenizer and SFT rows from this probe "
                             "directory (same tokenizer / stagebank / sft.num_examples settings)")
_BASE_ONLY = flags.DEFINE_bool("base_only", False, "stop after the tiny base (model.source="
                                "tiny_base): print its record (copy accuracy, time)")
_MAX_ROWS = flags.DEFINE_integer("max_rows", 64, "validation rows to decode at most")
flags.mark_flags_as_required(["workdir"])


def _validation_rows(cfg, rows_dir: Path, chat_format) -> list[tuple[dict, list[int], list[int]]]:
  """`(metadata, prompt ids, target ids)` of the rows `setup.sft_examples` holds out."""
  from bat_jax.bicurl import setup
  from bat_jax.stagebank import sft_rows
  rows = sft_rows.load_sft_rows(rows_dir)
  encoded = [chat_format.encode_sft_example(r["messages"], sft_rows.target_action(r)) for r in rows]
  kept = [i for i, (ids, _) in enumerate(encoded) if len(ids) <= cfg.sft.max_seq_len]
  order = list(range(len(kept)))
  random.Random(cfg.seed).shuffle(order)  # the permutation `sft_examples` applies
  train, validation = setup.sft_examples(cfg, rows_dir, chat_format)
  out = []
  for j in order[:len(validation)]:
    ids, mask = encoded[kept[j]]
    start = mask.index(1)
    out.append((rows[kept[j]]["metadata"], ids[:start], ids[start:]))
  if [p + t for _, p, t in out] != [ids for ids, _ in validation]:
    raise AssertionError("probe rows differ from setup.sft_examples' validation split")
  return out


def _code(chat_format, text: str) -> str | None:
  turn = chat_format.parse_actions(text)
  if not turn.ok or not turn.actions:
    return None
  return turn.actions[0]["arguments"].get("code", "").strip()


def decode_scores(cfg, model, chat_format, rows) -> dict:
  """Greedy target turns of `rows`; `{format, exact}` rates per stage and per action index."""
  from bat_jax.bicurl.policy import JaxPolicyServer
  from bat_jax.rollout.engine import GenerateRequest, SamplingParams
  engine = JaxPolicyServer(model, cfg).engine
  greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.limits.max_turn_tokens)
  done = engine.generate([GenerateRequest(prompt, greedy) for _, prompt, _ in rows])
  tally = collections.defaultdict(lambda: [0, 0, 0])
  samples = []
  for (meta, _, target), completion in zip(rows, done):
    want = _code(chat_format, chat_format.decode(target))
    got_text = chat_format.decode(completion.output_ids)
    got = _code(chat_format, got_text)
    for key in (f"stage={meta['stage']}", f"action={meta['action_index']}", "all"):
      tally[key][0] += 1
      tally[key][1] += got is not None
      tally[key][2] += got == want
    if got != want and len(samples) < 8:
      samples.append({"stage": meta["stage"], "want": want, "got": got or got_text[-160:]})
  return {"rates": {k: {"n": n, "format": f / n, "exact": e / n}
                    for k, (n, f, e) in sorted(tally.items())}, "misses": samples}


def main(argv: list[str]) -> None:
  del argv
  import jax
  from bat_jax.bicurl import bank as bank_lib, loop, policy, setup
  from bat_jax.bicurl.state import RunPaths
  from bat_jax.checkpointing import export_hf
  from bat_jax.evaluator.cells import load_or_create_secret
  from bat_jax.run_config import RunConfig
  cfg = RunConfig.from_config(_CONFIG.value)
  paths = RunPaths(Path(_WORKDIR.value).absolute())
  paths.workdir.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(paths.workdir / "xla_cache"))
  t0 = time.time()
  if _REUSE.value:  # the secret too: the copied rows were leak-checked against its cells
    for rel in ("eval_secret", "tokenizer", "stagebank/sft", "stagebank/markers.json"):
      src, dst = Path(_REUSE.value) / rel, paths.workdir / rel
      if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
  # The held-out cells are keyed by WORKDIR/eval_secret, as in the main job: the markers the
  # base, the SFT rows and `--heldout` use. Copy a run's secret in first to probe on its cells.
  secret = load_or_create_secret(paths.eval_secret)
  cfg = dataclasses.replace(cfg, evaluation=dataclasses.replace(cfg.evaluation, secret=secret))
  tok_dir = setup.prepare_tokenizer(cfg, paths.tokenizer)
  chat_format = setup.chat_format(cfg, tok_dir)
  if not paths.markers.is_file():
    bank_lib.write_markers(cfg, paths.markers)
  t_setup = time.time() - t0
  # The main job's own tiny base and cold start (private to the loop; the probe must not
  # drift from them).
  start, base = None, None
  if cfg.model.source == "tiny_base":
    start, base = loop._tiny_base(cfg, paths, tok_dir)  # pylint: disable=protected-access
    if _BASE_ONLY.value:
      print(json.dumps(base, indent=1, default=str))
      return
  elif cfg.model.source == "pretrained":
    start = Path(cfg.model.path)
  rows_dir = setup.prepare_sft_rows(cfg, paths.sft_rows, paths.markers)
  t_base = time.time() - t0 - t_setup  # SFT rows included
  cold_start, tracker = loop._cold_start, loop._Tracker  # pylint: disable=protected-access
  model, nll = cold_start(cfg, paths, chat_format, tracker(cfg, paths), start)
  t_sft = time.time() - t0 - t_setup - t_base
  rows = _validation_rows(cfg, rows_dir, chat_format)[:_MAX_ROWS.value]
  result = {"validation_nll": nll, "pretrain": base,
            "seconds": {"setup": t_setup, "pretrain": t_base, "sft": t_sft},
            **decode_scores(cfg, model, chat_format, rows)}
  result["seconds"]["decode"] = time.time() - t0 - sum(result["seconds"].values())
  if _HELDOUT.value:
    export_hf(model, paths.policy("sft"), tokenizer_dir=tok_dir)
    server = policy.make_policy_server(model, cfg, paths.workdir, tok_dir)
    report = policy.evaluate_policy(cfg, server, chat_format, paths.policy("sft"),
                                    paths.eval_report("sft"), paths.eval_records("sft"))
    result["heldout"] = {k: report.get(k) for k in ("overall", "stage_scores", "task",
                                                   "agentic", "failure_categories")}
    result["seconds"]["heldout"] = time.time() - t0 - sum(result["seconds"].values())
  text = json.dumps(result, indent=1, default=str)
  (paths.workdir / "probe.json").write_text(text)
  print(text)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  app.run(main)
