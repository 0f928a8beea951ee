"""One GRPO update (forward, backward, AdamW) in tokens/s: bat_jax vs transformers + torch.

`--mode compare` (default, CPU): the bat_jax step (`bat_jax.train` with `bat_jax.grpo`'s loss: chunked taken-token logprobs,
clipped loss + k3 KL, seq-mean-token-mean, global-norm clipping, AdamW) and the same update in
PyTorch (a transformers model with the same weights, full-logits log-softmax, the same loss
written in torch, `clip_grad_norm_` + `torch.optim.AdamW`) on the same tiny config and batch.
Each side runs in its own child process so its peak RSS is its own; the parent prints both and
the ratio last. The first-step losses are printed too: equal weights and batch -> equal loss.

`--mode mfu` (GPU): a random ~1.9B Qwen3.5 config in bf16 with remat; prints step time,
tokens/s and model FLOP utilisation (6 * matmul params + causal attention per token, against
`--peak_tflops`, default H200 bf16 dense). `--preset tiny` runs the same path on CPU as a smoke
test.

`--old_logp pass|step` adds where the ratio's old logprobs come from (`grpo.old_logp`) to both
sides' timed step: a no-grad forward before it, or the step's own logprobs detached; the
difference of the two runs' ms/step is what the loop saves per GRPO step.

  PYTHONPATH=. python experiments/perf/grpo_step.py --batch 8 --seq 256
  PYTHONPATH=. python experiments/perf/grpo_step.py --mode mfu --preset 1.9b --batch 8 --seq 4096
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from model_fwd_bwd import time_it, tiny_config  # noqa: E402  (shared perf helpers)

CLIP, KL_COEF, LR, TEMPERATURE = 0.2, 0.006, 2.5e-7, 0.7


def grpo_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Random prompt+response tokens; the response (mask 1) starts at seq/4, ragged ends."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (batch, seq), dtype=np.int32)
  ends = rng.integers(seq // 2, seq + 1, batch)
  pos = np.arange(seq)[None]
  mask = ((pos >= seq // 4) & (pos < ends[:, None])).astype(np.float32)
  old = (-np.log(vocab) + 0.1 * rng.normal(size=(batch, seq))).astype(np.float32) * mask
  ref = (old + 0.05 * rng.normal(size=(batch, seq))).astype(np.float32) * mask
  adv = rng.normal(size=batch).astype(np.float32)
  # Every token real (valid), like the PyTorch reference, which gets no attention mask.
  return {"input_ids": ids, "valid": np.ones_like(ids, bool), "loss_mask": mask,
          "old_logp": old, "ref_logp": ref,
          "advantages": adv}


def _rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _jax_step(hf_dict: dict, args, out_dir: str):
  """(compiled step, run-one-step callable) for the bat_jax GRPO update; saves the weights."""
  import jax
  from flax import nnx

  from bat_jax import grpo, train
  from bat_jax.model import ModelConfig, build_model, save_pretrained

  model = build_model(ModelConfig.from_hf_dict(hf_dict), rngs=nnx.Rngs(0))
  save_pretrained(model, out_dir)  # the torch side loads these exact weights
  graphdef, params, rest = train.split_model(model)
  optimizer_cfg = train.OptimizerConfig(learning_rate=LR, max_grad_norm=1.0)
  optimizer = train.make_optimizer(optimizer_cfg)
  loss_cfg = grpo.GrpoConfig(clip_low=CLIP, clip_high=CLIP, kl_coef=KL_COEF,
                             temperature=TEMPERATURE, logprob_chunk_size=args.chunk,
                             logprob_save_probs=args.save_probs)
  step_fn = train.build_step_fn(graphdef, grpo.grpo_loss_fn(loss_cfg), optimizer,  # as Trainer
                               train.StepConfig(num_micro_batches=args.micro),
                               optimizer_cfg=optimizer_cfg)
  batch = jax.device_put(grpo_batch(args.batch, args.seq, hf_dict["vocab_size"]))
  if args.old_logp == "step":   # grpo.old_logp = "step": the update scores its own
    batch.pop("old_logp")
  frozen = {"rest": rest, "ref_params": None}
  state = train.init_train_state(params, optimizer, seed=0)
  compiled = train.make_train_step(step_fn).lower(state, batch, frozen).compile()  # AOT
  holder = {"state": state}
  old_logp_pass = jax.jit(lambda p: grpo.taken_token_logprobs(  # grpo.old_logp = "pass"
      nnx.merge(graphdef, p, rest), batch["input_ids"], valid=batch["valid"],
      chunk_size=args.chunk, temperature=TEMPERATURE)[0])

  def step():
    if args.old_logp == "pass":
      batch["old_logp"] = old_logp_pass(holder["state"].params)
    holder["state"], metrics = compiled(holder["state"], batch, frozen)
    return jax.block_until_ready(metrics)

  return compiled, step


def run_jax(hf_dict: dict, args, out_dir: str, conn) -> None:
  _host_malloc(args)
  from bat_jax import train

  compiled, step = _jax_step(hf_dict, args, out_dir)
  rss_before = _rss_mb()
  first_loss = float(step()["loss"])
  conn.send({"loss": first_loss, "rss_before_mb": rss_before, "xla_mb": {
      k: v / 2**20 for k, v in train.memory_report(compiled).items()}})
  _serve_timings(step, args.iters, conn)


def run_torch(args, weights_dir: str, conn) -> None:
  _host_malloc(args)
  import torch
  import transformers

  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_pretrained(weights_dir,
                                                            dtype=torch.float32).train()
  opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=0.0)
  b = {k: torch.as_tensor(v) for k, v in grpo_batch(args.batch, args.seq,
                                                    model.config.vocab_size).items()}
  ids = b["input_ids"].long()

  def taken_logp():
    logits = model(input_ids=ids).logits[:, :-1].float() / TEMPERATURE
    taken = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(taken, (1, 0))

  def loss_fn():
    if args.old_logp == "pass":
      with torch.no_grad():
        b["old_logp"] = taken_logp()
    logp = taken_logp()
    old_logp = logp.detach() if args.old_logp == "step" else b["old_logp"]
    mask, adv = b["loss_mask"], b["advantages"][:, None]
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    log_r = b["ref_logp"] - logp
    per_token = pg + KL_COEF * (torch.exp(log_r) - log_r - 1)
    tokens = mask.sum(-1)
    per_seq = (per_token * mask).sum(-1) / tokens.clamp(min=1)
    return per_seq[tokens > 0].mean()

  def step():
    opt.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()

  rss_before = _rss_mb()
  first_loss = float(step())
  conn.send({"loss": first_loss, "rss_before_mb": rss_before, "threads": torch.get_num_threads()})
  _serve_timings(step, args.iters, conn)


def _host_malloc(args) -> None:
  """Both children run with the trainer's malloc settings (`bat_jax.host_memory`, set by
  launch.py) unless `--default_malloc`, so neither side pays for re-faulting freed pages."""
  if not args.default_malloc:
    from bat_jax import host_memory
    host_memory.retain_freed_memory()


def _page_faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _serve_timings(step, iters: int, conn) -> None:
  """Times `iters` steps whenever the parent asks; None ends the child."""
  while conn.recv() is not None:
    faults = _page_faults()
    seconds = time_it(step, iters)  # 2 warm-up steps + `iters` timed
    conn.send({"seconds": seconds, "peak_rss_mb": _peak_rss_mb(),
               "faults_per_step": (_page_faults() - faults) / (iters + 2)})


def _start_child(target, *args):
  ctx = mp.get_context("spawn")
  parent, child = ctx.Pipe()
  proc = ctx.Process(target=target, args=(*args, child))
  proc.start()
  return proc, parent, parent.recv()


def compare(args) -> None:
  """Both sides stay up; timings alternate jax, torch, jax, ... so a loaded box slows both alike.
  The ratio is the median of the per-round ratios."""
  hf_dict = tiny_config(args.family, args.layers)
  tokens = args.batch * args.seq
  with tempfile.TemporaryDirectory() as tmp:
    jax_proc, jax_conn, jax_r = _start_child(run_jax, hf_dict, args, tmp)
    torch_proc, torch_conn, torch_r = _start_child(run_torch, args, tmp)
    rounds = []
    for _ in range(args.repeats):
      timed = []
      for conn in (jax_conn, torch_conn):
        conn.send("time")
        timed.append(conn.recv())
      rounds.append(timed)
    for conn, proc in ((jax_conn, jax_proc), (torch_conn, torch_proc)):
      conn.send(None)
      proc.join()
  print(f"config: family={args.family} layers={args.layers} batch={args.batch} seq={args.seq} "
        f"micro={args.micro} chunk={args.chunk} old_logp={args.old_logp} "
        f"torch_threads={torch_r['threads']} "
        f"rounds={args.repeats}x{args.iters} steps "
        f"malloc={'default' if args.default_malloc else 'bat_jax.host_memory (both)'}")
  print(f"first-step loss: jax={jax_r['loss']:.6f} torch={torch_r['loss']:.6f}")
  for i, (j, t) in enumerate(rounds):
    print(f"round {i}: jax {j['seconds'] * 1e3:8.1f} ms/step ({tokens / j['seconds']:7.0f} tok/s)  "
          f"torch {t['seconds'] * 1e3:8.1f} ms/step ({tokens / t['seconds']:7.0f} tok/s)  "
          f"ratio {t['seconds'] / j['seconds']:.2f}")
  for name, r, last in (("jax", jax_r, rounds[-1][0]), ("torch", torch_r, rounds[-1][1])):
    print(f"{name:5s} peak RSS {last['peak_rss_mb']:7.0f} MB (before step "
          f"{r['rss_before_mb']:.0f}); minor page faults per step {last['faults_per_step']:.0f}")
  print("jax XLA memory analysis (MB): " +
        ", ".join(f"{k.replace('_size_in_bytes', '')}={v:.1f}" for k, v in jax_r["xla_mb"].items()))
  ratios = sorted(t["seconds"] / j["seconds"] for j, t in rounds)
  print(f"ratio jax/torch tokens/s (median of {len(ratios)} rounds): {ratios[len(ratios) // 2]:.2f}")


def profile(args) -> None:
  """Per-op time of the jax step, summed per bat_jax source line (see xla_profile.py)."""
  from xla_profile import profile as xla_profile

  _host_malloc(args)  # profile what `compare` times
  with tempfile.TemporaryDirectory() as tmp:
    compiled, step = _jax_step(tiny_config(args.family, args.layers), args, tmp)
    step()
    print(f"config: family={args.family} layers={args.layers} batch={args.batch} seq={args.seq} "
          f"micro={args.micro} chunk={args.chunk}")
    print("\n".join(xla_profile(compiled, step, iters=args.iters)))


def qwen3_5_width(*, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                  linear_v_heads: int, tie: bool) -> dict:
  """HF config of a Qwen3.5 text model at real vocab / head sizes (DeltaNet x3 + attention)."""
  return dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=hidden,
              intermediate_size=intermediate, num_hidden_layers=layers,
              layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                           for i in range(layers)],
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
              linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_num_key_heads=16, linear_num_value_heads=linear_v_heads,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                               "partial_rotary_factor": 0.25},
              max_position_embeddings=32768, tie_word_embeddings=tie)


def qwen3_5_preset(name: str) -> dict:
  """Random Qwen3.5 configs: `1.9b` (Qwen3.5 vocab, 3:1 DeltaNet:attention) and `tiny`."""
  if name == "tiny":
    return tiny_config("qwen3_5", 4)
  return qwen3_5_width(layers=24, hidden=2048, intermediate=6144, heads=8, kv_heads=2,
                       linear_v_heads=16, tie=True)


def model_flops_per_token(cfg, n_params: int, seq: int) -> int:
  """Training FLOPs per token (forward + backward, no remat recompute) of a `ModelConfig` with
  `n_params` params at sequence length `seq`: 6 per matmul param (an untied input embedding is
  a gather, no FLOPs; a tied one is also the unembedding matmul) plus causal attention."""
  n_matmul = n_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
  n_attn = sum(t == "full_attention" for t in cfg.layer_types)
  return 6 * n_matmul + 6 * n_attn * cfg.num_attention_heads * cfg.head_dim * seq  # T/2 causal


def mfu(args) -> None:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from bat_jax import grpo, train
  from bat_jax.model import ModelConfig, build_model

  hf_dict = qwen3_5_preset(args.preset)
  cfg = ModelConfig.from_hf_dict(hf_dict, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  model = build_model(cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = train.split_model(model)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  flops_per_token = model_flops_per_token(cfg, n_params, args.seq)
  optimizer = train.make_optimizer(train.OptimizerConfig(learning_rate=LR))
  step_fn = train.build_step_fn(
      graphdef, grpo.grpo_loss_fn(grpo.GrpoConfig(kl_coef=KL_COEF, logprob_chunk_size=args.chunk,
                                                  temperature=TEMPERATURE)),
      optimizer, train.StepConfig(num_micro_batches=args.micro, remat_policy=args.remat))
  batch = jax.device_put(grpo_batch(args.batch, args.seq, cfg.vocab_size))
  frozen = {"rest": rest, "ref_params": None}
  state = train.init_train_state(params, optimizer, seed=0)
  compiled = train.make_train_step(step_fn).lower(state, batch, frozen).compile()  # AOT
  holder = {"state": state}

  def step():
    holder["state"], metrics = compiled(holder["state"], batch, frozen)
    return jax.block_until_ready(metrics)

  seconds = time_it(step, args.iters)
  tokens = args.batch * args.seq
  achieved = flops_per_token * tokens / seconds
  stats = jax.devices()[0].memory_stats() or {}
  print(f"preset={args.preset} params={n_params / 1e9:.2f}B batch={args.batch} seq={args.seq} "
        f"micro={args.micro} remat={args.remat} device={jax.devices()[0].device_kind}")
  print("XLA memory (GB): " + ", ".join(f"{k.replace('_size_in_bytes', '')}={v / 2**30:.2f}"
                                          for k, v in train.memory_report(compiled).items()))
  if "peak_bytes_in_use" in stats:
    print(f"device peak bytes in use: {stats['peak_bytes_in_use'] / 2**30:.2f} GB")
  print(f"step {seconds:.3f} s  {tokens / seconds:.0f} tokens/s  {achieved / 1e12:.1f} TFLOP/s")
  print(f"MFU: {achieved / (args.peak_tflops * 1e12):.3f}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mode", choices=["compare", "mfu", "profile"], default="compare")
  parser.add_argument("--family", choices=["qwen3", "qwen3_5"], default="qwen3_5")
  parser.add_argument("--preset", choices=["tiny", "1.9b"], default="1.9b")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--micro", type=int, default=1)
  parser.add_argument("--chunk", type=int, default=128)
  parser.add_argument("--save_probs", action=argparse.BooleanOptionalAction, default=True,
                      help="compare mode: keep the [B, T, V] softmax for the backward (the "
                           "tiny config's choice; the 9B configs recompute the logits)")
  parser.add_argument("--default_malloc", action="store_true",
                      help="compare mode: glibc's default malloc settings in both children "
                           "instead of the trainer's (bat_jax.host_memory)")
  parser.add_argument("--remat", default="full")
  parser.add_argument("--old_logp", choices=["given", "pass", "step"], default="given",
                      help="given: precomputed inputs; pass: a no-grad forward scores them "
                      "before each step (grpo.old_logp=pass); step: the step's own, detached "
                      "(grpo.old_logp=step). Both sides do the same.")
  parser.add_argument("--iters", type=int, default=3)
  parser.add_argument("--repeats", type=int, default=3, help="alternating timing rounds")
  parser.add_argument("--peak_tflops", type=float, default=989.0)
  args = parser.parse_args()
  {"compare": compare, "mfu": mfu, "profile": profile}[args.mode](args)


if __name__ == "__main__":
  main()
