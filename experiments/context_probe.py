r"""Which decisions a policy makes right, in which context: greedy calls on fresh training tasks.

  python experiments/context_probe.py --run=runs/tiny [--policy=sft] [--tasks=3]

For every track and outcome, `--tasks` fresh training tasks (a seed no run's SFT set uses) are
executed by the expert in the sandbox, and each decision of interest becomes a teacher-forced
row (every earlier call and its real observation given), decoded greedily by the run's exported
policy (`RUN/policies/POLICY`, `RUN/tokenizer`):

- E2E rows from the reaction to validation on (`E2E/<outcome>/<action index>`), the decisions a
  held-out episode's later turns make, after a history of earlier stages;
- the stage-local rows that ask for the same decisions: S3's calls of a recovery task (the fix
  after the fault line), S4's and S5's first call (the handoff in the brief).

Per row kind: `format` (a parsed call) and `exact` (the expert's code), and what was called
instead. A decision right in its stage-local row and wrong in the E2E row does not transfer from
stage-local practice to held-out episodes (experiments/README.md, "Cut at both ends").
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

from absl import app, flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

_RUN = flags.DEFINE_string("run", None, "a run directory (tokenizer/, policies/)")
_POLICY = flags.DEFINE_string("policy", "sft", "the exported policy under RUN/policies/")
_TASKS = flags.DEFINE_integer("tasks", 3, "fresh tasks per (track, outcome)")
_SEED = flags.DEFINE_integer("seed", 4242, "the probe tasks' SFT-spec seed")
_SHOW = flags.DEFINE_integer("show_wrong", 0, "print up to this many wrong completions per kind")
flags.mark_flags_as_required(["run"])

FOCI = ("E2E", "S3", "S4", "S5")
REACTION = 3  # an E2E episode's action after plan, setup and validate


def _probed(meta: dict) -> bool:
  stage, k = meta["stage"], meta["action_index"]
  return ((stage == "E2E" and k >= REACTION) or (stage in ("S4", "S5") and k == 0)
          or (stage == "S3" and meta["outcome"] == "recovery"))


def _called(code) -> str:
  if code is None:
    return "no call (stop or garbled)"
  command = code.split(" --")[0]
  return command + (" --blocked" if "--blocked" in code else "")


def main(argv: list[str]) -> None:
  del argv
  import json
  import tiny_probe
  from bat_jax.bicurl import setup
  from bat_jax.bicurl.policy import JaxPolicyServer
  from bat_jax.model import hf_io
  from bat_jax.rollout.engine import GenerateRequest, SamplingParams
  from bat_jax.run_config import RunConfig
  from bat_jax.stagebank import grid, sft_rows
  from configs import tiny
  run = Path(_RUN.value)
  cfg = RunConfig.from_config(tiny.get_config())
  chat = setup.chat_format(cfg, run / "tokenizer")
  model = hf_io.load_pretrained(run / "policies" / _POLICY.value)
  spec = sft_rows.SftSpec(seed=_SEED.value, tasks_per_state=_TASKS.value,
                          states=tuple(s for s in grid.SOURCE_GRID if s.focus in FOCI),
                          action_space="stage_tools")
  rows = []
  for row in sft_rows.synthesize(spec, workers=2):
    meta = row["metadata"]
    if _probed(meta):
      ids, mask = chat.encode_sft_example(row["messages"], sft_rows.target_action(row))
      start = mask.index(1)
      rows.append((f"{meta['stage']}/{meta['outcome']}/{meta['action_index']}", ids[:start],
                   ids[start:]))
  greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.limits.max_turn_tokens)
  done = JaxPolicyServer(model, cfg).engine.generate(
      [GenerateRequest(prompt, greedy) for _, prompt, _ in rows])
  table: dict = collections.defaultdict(lambda: {"n": 0, "format": 0, "exact": 0,
                                                 "called": collections.Counter()})
  for (key, _, target), completion in zip(rows, done):
    want = tiny_probe._code(chat, chat.decode(target))  # pylint: disable=protected-access
    got = tiny_probe._code(chat, chat.decode(completion.output_ids))  # pylint: disable=protected-access
    entry = table[key]
    entry["n"] += 1
    entry["format"] += got is not None
    entry["exact"] += got == want
    entry["called"][_called(got) + ("" if got == want else " (wrong)")] += 1
    if got != want and entry["n"] - entry["exact"] <= _SHOW.value:
      print(f"{key}: wanted {want!r}, wrote {chat.decode(completion.output_ids)!r}")
  print(f"{'row kind':<18} {'n':>3} {'format':>7} {'exact':>6}  called")
  for key in sorted(table):
    e = table[key]
    print(f"{key:<18} {e['n']:>3} {e['format'] / e['n']:>7.2f} {e['exact'] / e['n']:>6.2f}  "
          + json.dumps(dict(e["called"].most_common())))


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  app.run(main)
