"""One SFT update (forward, backward, AdamW) on rows whose loss is a short target at the end:
the head at every position vs at the targets only (`SftConfig.head_on_targets`), against
transformers + torch on the same weights and rows.

The tiny run's SFT rows are ~400-1,100 tokens with one target action of <= ~80 tokens (the tiny
base's packed rows: 256 tokens, about a third of them calls). Sides:

  jax_all       bat_jax's SFT step, head + softmax at every position (`head_on_targets=False`)
  jax_targets   the same step, head at each row's target positions only (the default)
  torch         transformers' forward to the final hidden states, then the head and
                log-softmax at the target positions only (the same algorithm), AdamW

Timings alternate between the sides (`--rounds` rounds of `--iters` steps), so a loaded box
slows all alike; the first-step losses must agree (same weights, same rows). The ratio
torch / jax_targets (median over rounds) is printed last.

  PYTHONPATH=. python experiments/perf/sft_step.py --batch 8 --seq 512 --targets 80
  PYTHONPATH=. python experiments/perf/sft_step.py --batch 16 --seq 256 --targets 96 --base
  PYTHONPATH=. python experiments/perf/sft_step.py --batch 16 --seq 256 --targets 96 --base --profile

`--profile`: no timing against torch; the JAX step's op time per step, summed per `bat_jax`
source line (`xla_profile.py`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # xla_profile
LR = 1e-3


def sft_rows(batch: int, seq: int, targets: int, vocab: int, seed: int = 0) -> dict:
  """Ragged rows (lengths in [seq/2, seq]) whose last `targets` tokens carry the loss."""
  from bat_jax.sft import pad_example
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch):
    length = int(rng.integers(seq // 2, seq + 1))
    mask = np.zeros(length, np.int32)
    mask[length - targets:] = 1
    rows.append(pad_example(rng.integers(1, vocab, length), mask, max_len=seq, pad_id=0))
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def jax_side(hf_dict: dict, rows: dict, targets: int, head_on_targets: bool, out_dir: str,
             with_compiled: bool = False):
  """`step()` -> loss of bat_jax's SFT update; saves the initial weights for torch. With
  `with_compiled`: (compiled, step, {"lower": s, "compile": s}), the AOT stages' seconds."""
  import jax
  from flax import nnx

  from bat_jax import train
  from bat_jax.model import ModelConfig, build_model, save_pretrained
  from bat_jax.sft import sft_loss_fn

  model = build_model(ModelConfig.from_hf_dict(hf_dict), rngs=nnx.Rngs(0))
  save_pretrained(model, out_dir)
  graphdef, params, rest = train.split_model(model)
  optimizer = train.make_optimizer(train.OptimizerConfig(learning_rate=LR))
  loss_fn = sft_loss_fn(chunk_size=256, targets_per_row=targets if head_on_targets else None)
  step_fn = train.build_step_fn(graphdef, loss_fn, optimizer, train.StepConfig())
  batch = jax.device_put(rows)
  frozen = {"rest": rest, "ref_params": None}
  holder = {"state": train.init_train_state(params, optimizer, seed=0)}
  start = time.perf_counter()
  lowered = train.make_train_step(step_fn).lower(holder["state"], batch, frozen)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  seconds = {"lower": lowered_at - start, "compile": time.perf_counter() - lowered_at}

  def step() -> float:
    holder["state"], metrics = compiled(holder["state"], batch, frozen)
    return float(jax.block_until_ready(metrics)["loss"])
  return (compiled, step, seconds) if with_compiled else step


def torch_side(weights_dir: str, rows: dict, targets: int):
  import torch
  import transformers

  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_pretrained(weights_dir,
                                                            dtype=torch.float32).train()
  opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=0.0)
  ids = torch.as_tensor(rows["input_ids"]).long()
  valid = torch.as_tensor(rows["valid"]).long()
  scored = torch.as_tensor(rows["loss_mask"][:, 1:]).bool()         # predicted tokens
  labels = ids[:, 1:][scored]

  def step() -> float:
    opt.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=ids, attention_mask=valid).last_hidden_state[:, :-1]
    logits = model.lm_head(hidden[scored]).float()                   # [N, V]: targets only
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    opt.step()
    return float(loss.detach())
  return step


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--targets", type=int, default=80, help="target tokens per row")
  parser.add_argument("--base", action="store_true", help="the tiny base's layer order")
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--profile", action="store_true",
                      help="per-op time of the JAX step by source line (xla_profile.py); no torch")
  args = parser.parse_args()
  from configs import tiny
  cfg = tiny.get_config("base" if args.base else None)
  hf_dict = cfg.model.hf_config.to_dict()
  hf_dict["vocab_size"] = int(cfg.tokenizer.train.vocab_size)
  rows = sft_rows(args.batch, args.seq, args.targets, hf_dict["vocab_size"])
  if args.profile:
    from xla_profile import profile
    with tempfile.TemporaryDirectory() as tmp:
      compiled, step, _ = jax_side(hf_dict, rows, args.targets, True, tmp, with_compiled=True)
      step()
      print("\n".join(profile(compiled, step, iters=args.iters, top=30)))
    return
  with tempfile.TemporaryDirectory() as tmp:
    sides = {"jax_all": jax_side(hf_dict, rows, args.targets, False, tmp),
             "jax_targets": jax_side(hf_dict, rows, args.targets, True, tmp + "/t"),
             "torch": torch_side(tmp, rows, args.targets)}
    first = {name: step() for name, step in sides.items()}       # compiles; equal weights
    print("first-step loss: " + ", ".join(f"{k} {v:.5f}" for k, v in first.items()))
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
      for name, step in sides.items():
        step()
        start = time.perf_counter()
        for _ in range(args.iters):
          step()
        seconds[name].append((time.perf_counter() - start) / args.iters)
  tokens = args.batch * args.seq
  for name, xs in seconds.items():
    ms = statistics.median(xs) * 1e3
    print(f"{name:12s} {ms:8.1f} ms/step  {tokens / ms * 1e3:9.0f} tok/s  (rounds: "
          + ", ".join(f"{x * 1e3:.1f}" for x in xs) + ")")
  per_round = lambda a, b: statistics.median(x / y for x, y in zip(seconds[a], seconds[b]))
  print(f"jax_all / jax_targets: {per_round('jax_all', 'jax_targets'):.2f}x")
  print(f"torch / jax_targets: {per_round('torch', 'jax_targets'):.2f}x")


if __name__ == "__main__":
  main()
