"""Evaluator-style serving: continuous (stepped) vs whole-request batching in `EngineWorker`.

`--cells` cells run on `--workers` threads (as the built-in evaluator runs its 42 cells on 16),
each playing 2..`--turns` turns on one session: generate a turn (greedy, a turn length drawn
per cell and turn, as real turns stop at different tokens), then "run a tool" (sleep a drawn
time) and append an observation (drawn tokens), then the next turn over the whole history. The same cells run twice on the
tiny config's model (real widths, random weights) in one JAX engine of `--slots` slots:

* reference: `step_tokens=None`, whole requests batched when they arrive together (the
  evaluator's batching before continuous batching);
* stepped: `step_tokens=--step` (the evaluator's `EVAL_STEP_TOKENS`): a turn that arrives while
  others decode joins at the next step.

Both must produce the same tokens (asserted). Prints wall seconds, engine calls and mean rows
per call of each; the last line is the speed-up (reference wall / stepped wall).

  PYTHONPATH=. python experiments/perf/engine_worker_batching.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import numpy as np


def tiny_model():
  from flax import nnx

  from bat_jax.model import ModelConfig, build_model
  from configs import tiny
  hf = tiny.get_config().model.hf_config.to_dict()
  return build_model(ModelConfig.from_hf_dict(hf), rngs=nnx.Rngs(0))


def play_cells(worker, args) -> tuple[float, list[list[int]]]:
  """Wall seconds of all cells and each cell's final token history."""
  from bat_jax.rollout import GenerateRequest, SamplingParams
  histories: list[list[int]] = [[] for _ in range(args.cells)]

  def cell(i: int) -> None:
    rng = np.random.default_rng(1000 + i)
    ids = rng.integers(10, 1000, args.prompt).tolist()
    for _ in range(int(rng.integers(2, args.turns + 1))):
      sampling = SamplingParams(max_new_tokens=int(rng.integers(16, args.turn_tokens + 1)),
                                temperature=0.0)
      c = worker.submit_generate(GenerateRequest(ids, sampling, f"cell{i}")).result(600)
      ids = ids + list(c.output_ids)
      time.sleep(float(rng.uniform(0.1, args.tool_s)))
      ids = ids + rng.integers(10, 1000, int(rng.integers(40, 160))).tolist()
    histories[i] = ids

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
    list(pool.map(cell, range(args.cells)))
  return time.perf_counter() - start, histories


def measure(model, step_tokens, args) -> dict:
  from bat_jax.rollout import JaxEngine, JaxEngineConfig
  from bat_jax.rollout.worker import EngineWorker
  engine = JaxEngine(model, JaxEngineConfig(num_slots=args.slots, max_len=args.max_len,
                                            prefill_chunk=256))
  worker = EngineWorker(engine, max_batch=args.slots, step_tokens=step_tokens)
  play_cells(worker, args)  # compile every span / chunk the cells reach
  engine.flush()
  worker.steps, worker.step_sizes = 0, []
  seconds, histories = play_cells(worker, args)
  worker.close()
  return {"seconds": seconds, "calls": worker.steps,
          "rows": float(np.mean(worker.step_sizes)), "histories": histories}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cells", type=int, default=42)
  parser.add_argument("--workers", type=int, default=16)
  parser.add_argument("--slots", type=int, default=16)
  parser.add_argument("--turns", type=int, default=7)
  parser.add_argument("--prompt", type=int, default=450)
  parser.add_argument("--turn_tokens", type=int, default=72)
  parser.add_argument("--tool_s", type=float, default=1.0)
  parser.add_argument("--max_len", type=int, default=2048)
  parser.add_argument("--step", type=int, default=16)
  args = parser.parse_args()
  model = tiny_model()
  whole = measure(model, None, args)
  stepped = measure(model, args.step, args)
  if whole["histories"] != stepped["histories"]:
    raise SystemExit("stepped and whole-request batching generated different tokens")
  for name, r in (("whole requests (reference)", whole), (f"steps of {args.step}", stepped)):
    print(f"{name}: {r['seconds']:.1f} s, {r['calls']} engine calls, "
          f"{r['rows']:.1f} rows per call", flush=True)
  print("greedy tokens equal in both: yes")
  print(f"speed-up (whole / stepped wall): {whole['seconds'] / stepped['seconds']:.2f}x")


if __name__ == "__main__":
  main()
