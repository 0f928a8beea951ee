"""Step time of the tiny config's SFT and GRPO train steps at a few padded lengths (CPU).

  PYTHONPATH=. python experiments/perf/tiny_phases.py --lengths 1024 2048 --batch 8

Prints compile time and the mean time of `--steps` steps per length, in wall and CPU seconds (on
a loaded box the CPU seconds are the steadier estimate: idle wall ~ CPU s / cores used); used to
size configs/tiny.py so the whole tiny run fits its ~15 minute budget.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bat_jax.bicurl import setup
from bat_jax.train import (OptimizerConfig, StepConfig, build_step_fn, init_train_state,
                           make_optimizer, make_train_step, split_model)
from bat_jax.sft import sft_loss_fn
from configs import tiny


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args()
  cfg = tiny.get_config()
  model = setup.initial_model(cfg)
  graphdef, params, rest = split_model(model)
  optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
  step = make_train_step(build_step_fn(graphdef, sft_loss_fn(), optimizer, StepConfig()))
  frozen = {"rest": rest, "ref_params": None}
  vocab = cfg.model.hf_config.vocab_size
  for length in args.lengths:
    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(0, vocab, (args.batch, length)), jnp.int32),
             "valid": jnp.ones((args.batch, length), bool),
             "loss_mask": jnp.ones((args.batch, length), jnp.int32).at[:, 0].set(0)}
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer, seed=0)  # donated
    t0, c0 = time.perf_counter(), time.process_time()
    state, m = step(state, batch, frozen)
    jax.block_until_ready(m["loss"])
    compile_s, compile_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
      state, m = step(state, batch, frozen)
    jax.block_until_ready(m["loss"])
    # CPU seconds hardly depend on what else runs on the box; wall seconds do.
    print(f"SFT step [{args.batch}, {length}]: first call {compile_s:.1f} s "
          f"({compile_cpu:.1f} CPU s), then {(time.perf_counter() - t0) / args.steps:.2f} s/step "
          f"({(time.process_time() - c0) / args.steps:.2f} CPU s/step)", flush=True)


if __name__ == "__main__":
  main()
