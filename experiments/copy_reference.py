"""Can the tiny model learn to copy? Our trainer vs transformers + torch on the same induction data.

Rows of random-token "echo" documents (`<a> x1..xk <b> x1..xk <eot>`, k in [12, 40), the loss on
the second copy only), packed to `--seq` tokens. Both sides start from the same weights (ours,
saved as HF safetensors), see the same rows in the same order and use the same AdamW (warmup +
cosine, global-norm clip 1). Each prints its masked NLL every `--every` steps; chance is
log(vocab - 3). A curve that falls on one side only is a defect on that side, not a plateau.

  PYTHONPATH=. python experiments/copy_reference.py --steps 400 --layers F,F,F,F
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))

TYPES = {"F": "full_attention", "L": "linear_attention"}


def hf_config(args) -> dict:
  from configs import tiny
  cfg = tiny.tiny_qwen3_5_text(args.vocab).to_dict()
  cfg["layer_types"] = [TYPES[t] for t in args.layers.split(",")]
  cfg["num_hidden_layers"] = len(cfg["layer_types"])
  cfg["hidden_size"] = args.width
  cfg["intermediate_size"] = 2 * args.width
  if args.full_rotary:
    cfg["rope_parameters"]["partial_rotary_factor"] = 1.0
  return cfg


def echo_rows(n_rows: int, seq: int, alphabet: int, seed: int, lengths: tuple[int, int] = (12, 40)
              ) -> tuple[np.ndarray, np.ndarray]:
  """`(ids, loss mask)`, both `[n_rows, seq]`: whole echo documents over token ids
  `3..alphabet+2`, padded with <eot> (id 2)."""
  rng = np.random.default_rng(seed)
  ids = np.full((n_rows, seq), 2, np.int32)
  mask = np.zeros((n_rows, seq), np.float32)
  for r in range(n_rows):
    pos = 0
    while True:
      k = int(rng.integers(*lengths))
      if pos + 2 * k + 3 > seq:
        break
      xs = rng.choice(np.arange(3, 3 + alphabet), size=k, replace=False)
      doc = np.concatenate([[0], xs, [1], xs, [2]])
      ids[r, pos:pos + len(doc)] = doc
      mask[r, pos + k + 2:pos + 2 * k + 2] = 1
      pos += len(doc)
  return ids, mask


def stages(args) -> list[tuple[int, int, int, int, int]]:
  """`(steps, batch, seq, kmin, kmax)` per curriculum stage (`--curriculum`; one stage without)."""
  if not args.curriculum:
    return [(args.stop or args.steps, args.batch, args.seq, args.kmin, args.kmax)]
  return [tuple(int(x) for x in stage.split(":")) for stage in args.curriculum.split(",")]


def batches(args):
  """Each step's `(ids, mask)`, stage after stage (each stage's rows drawn with its own seed)."""
  for i, (steps, batch, seq, kmin, kmax) in enumerate(stages(args)):
    ids, mask = echo_rows(steps * batch, seq, args.alphabet, args.seed + 1 + 1000 * i,
                          (kmin, kmax))
    for s in range(steps):
      yield ids[s * batch:(s + 1) * batch], mask[s * batch:(s + 1) * batch]


def lr_at(step: int, args) -> float:
  if step < args.warmup:
    return args.lr * step / args.warmup
  t = 0.0 if args.constant else (step - args.warmup) / max(args.steps - args.warmup, 1)
  return args.lr * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def run_jax(args, weights_dir: str, conn) -> None:
  from flax import nnx

  from bat_jax import train
  from bat_jax.model import ModelConfig, build_model, save_pretrained
  from bat_jax.sft import sft_loss_fn

  model = build_model(ModelConfig.from_hf_dict(hf_config(args)), rngs=nnx.Rngs(args.seed))
  save_pretrained(model, weights_dir)
  conn.send("saved")
  graphdef, params, rest = train.split_model(model)
  opt = train.make_optimizer(train.OptimizerConfig(
      learning_rate=args.lr, schedule="constant" if args.constant else "cosine", warmup_steps=args.warmup,
      total_steps=args.steps, max_grad_norm=1.0))
  step_fn = train.make_train_step(train.build_step_fn(
      graphdef, sft_loss_fn(), opt, train.StepConfig(num_micro_batches=1)))
  state = train.init_train_state(params, opt, seed=0)
  frozen = {"rest": rest, "ref_params": None}
  curve, start = [], time.perf_counter()
  for s, (ids, mask) in enumerate(batches(args)):
    batch = {"input_ids": ids, "loss_mask": mask, "valid": np.ones_like(ids, bool)}
    state, metrics = step_fn(state, batch, frozen)
    if (s + 1) % args.every == 0:
      curve.append(float(metrics["loss"]))
      print(f"jax step {s + 1}: {curve[-1]:.3f} ({time.perf_counter() - start:.0f} s)",
            flush=True)
  conn.send({"curve": curve, "seconds": time.perf_counter() - start})


def run_torch(args, weights_dir: str, conn) -> None:
  import torch
  import transformers

  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_pretrained(weights_dir,
                                                            dtype=torch.float32).train()
  opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=0.0)
  curve, start = [], time.perf_counter()
  for s, (ids, mask) in enumerate(batches(args)):
    for group in opt.param_groups:
      group["lr"] = lr_at(s, args)
    x = torch.as_tensor(ids).long()
    m = torch.as_tensor(mask)[:, 1:]
    logits = model(input_ids=x).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[..., 0]
    loss = -(logp * m).sum() / m.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if (s + 1) % args.every == 0:
      curve.append(float(loss.detach()))
  conn.send({"curve": curve, "seconds": time.perf_counter() - start})


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--stop", type=int, default=0, help="stop after this many steps (the "
                 "schedule still spans --steps)")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--vocab", type=int, default=1024)
  p.add_argument("--kmin", type=int, default=12, help="shortest list an echo copies")
  p.add_argument("--kmax", type=int, default=40, help="longest list + 1")
  p.add_argument("--curriculum", default="", help="stages STEPS:BATCH:SEQ:KMIN:KMAX,... run in "
                 "order (replaces --stop/--batch/--seq/--kmin/--kmax; the schedule spans --steps)")
  p.add_argument("--constant", action="store_true", help="hold the lr after warmup (no decay)")
  p.add_argument("--alphabet", type=int, default=1021, help="distinct tokens documents draw")
  p.add_argument("--width", type=int, default=128)
  p.add_argument("--layers", default="F,F,F,F", help="comma list of F (attention) / L (DeltaNet)")
  p.add_argument("--full_rotary", action="store_true", help="partial_rotary_factor 1.0")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=20)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--every", type=int, default=25)
  p.add_argument("--sides", default="jax,torch")
  args = p.parse_args()
  args.alphabet = min(args.alphabet, args.vocab - 3)
  ctx = mp.get_context("spawn")
  results = {}
  with tempfile.TemporaryDirectory() as weights_dir:
    a, b = ctx.Pipe()
    jax_proc = ctx.Process(target=run_jax, args=(args, weights_dir, b))
    jax_proc.start()
    assert a.recv() == "saved"
    if "torch" in args.sides:  # after the JAX side wrote the weights; the two then run together
      c, d = ctx.Pipe()
      torch_proc = ctx.Process(target=run_torch, args=(args, weights_dir, d))
      torch_proc.start()
      results["torch"] = c.recv()
      torch_proc.join()
    results["jax"] = a.recv()
    jax_proc.join()
  chance = math.log(args.alphabet)
  print(f"chance {chance:.2f} nats; layers {args.layers}, width {args.width}")
  print("step  " + "  ".join(f"{k:>7}" for k in results))
  for i in range(len(results["jax"]["curve"])):
    print(f"{(i + 1) * args.every:4d}  " + "  ".join(f"{r['curve'][i]:7.3f}"
                                               for r in results.values()))
  print(json.dumps({k: round(r["seconds"], 1) for k, r in results.items()}))
  if "torch" in results:
    print(f"final NLL jax/torch: {results['jax']['curve'][-1] / results['torch']['curve'][-1]:.2f}")


if __name__ == "__main__":
  main()
