"""Rollout throughput: JAX engine decode vs transformers `generate`, and full agent-loop rollouts.

Three measurements, one run:

1. decode tokens/s of `bat_jax.rollout.JaxEngine` against transformers' `generate` (PyTorch) on
   the same tiny model (a transformers model exported to HF safetensors and loaded with
   `bat_jax.model.load_pretrained`), the same batch, prompt length and number of new tokens,
   greedy, both with KV / recurrent caches;
2. full rollout throughput (trajectories per minute) of the agent loop with the real bubblewrap
   sandbox, tasks and rubric: a scripted expert policy (sandbox + rubric bound) and the tiny
   JAX policy (engine bound);
3. with `--gpu` on a GPU host: decode tokens/s and weight-sync seconds (HF safetensors export,
   reload, in-place param swap) for a random ~1B Qwen3.5 config in bf16.

The last line is the decode ratio (JAX / torch).

  PYTHONPATH=. python experiments/perf/rollout_decode.py --batch 8 --prompt 64 --new 64
  PYTHONPATH=. python experiments/perf/rollout_decode.py --batch 16 --prompt 512 --new 64 \
      --max_len 2048    # the tiny loop's cache (rollout.jax.max_len)
  PYTHONPATH=. python experiments/perf/rollout_decode.py --only_gpu --batch 64 --prompt 1024 \
      --new 512
  PYTHONPATH=. python experiments/perf/rollout_decode.py --only_gpu --gpu_preset tiny  # CPU smoke
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from model_fwd_bwd import tiny_config  # noqa: E402  (shared perf helpers)


def jax_decode(model, prompts: np.ndarray, new_tokens: int, *, max_len: int,
               repeats: int) -> tuple[float, list[list[int]]]:
  """Seconds per batched generate (compile excluded) and the generated ids."""
  from bat_jax.rollout import GenerateRequest, JaxEngine, JaxEngineConfig, SamplingParams
  batch, prompt_len = prompts.shape
  engine = JaxEngine(model, JaxEngineConfig(num_slots=batch, max_len=max_len,
                                            prefill_chunk=prompt_len, decode_block=new_tokens))
  sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
  requests = [GenerateRequest(p.tolist(), sampling) for p in prompts]
  engine.generate(requests)  # compile
  engine.flush()
  start = time.perf_counter()
  for _ in range(repeats):
    out = engine.generate(requests)
    engine.flush()
  return (time.perf_counter() - start) / repeats, [list(c.output_ids) for c in out]


def torch_decode(weights_dir: str, prompts: np.ndarray, new_tokens: int,
                 repeats: int) -> tuple[float, list[list[int]]]:
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(weights_dir).float().eval()
  ids = torch.as_tensor(prompts, dtype=torch.long)
  kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                use_cache=True, attention_mask=torch.ones_like(ids), pad_token_id=0)
  with torch.no_grad():
    model.generate(ids, **kwargs)  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
      out = model.generate(ids, **kwargs)
  return (time.perf_counter() - start) / repeats, out[:, prompts.shape[1]:].tolist()


def rollout_throughput(model, *, items: int, group: int, max_turns: int,
                       turn_tokens: int) -> None:
  """Trajectories/min of the agent loop with the real sandbox: expert script and tiny policy."""
  from bat_jax import workflow
  from bat_jax.model import tokenizer as tk
  from bat_jax.model.chat_format import ChatFormat
  from bat_jax.model import tokenizer_corpus
  from bat_jax.rollout import (AgentLoop, JaxEngine, JaxEngineConfig, RolloutItem,
                               RolloutLimits, SamplingParams, task_environments)
  from bat_jax.rollout.replay_engine import ScriptedEngine  # replays the expert (no model)
  from bat_jax.train_tasks import FAMILIES, expert_actions

  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    chat_format = ChatFormat.for_model(
        "qwen3_5_text",
        tk.load_tokenizer(tk.train_tokenizer(tokenizer_corpus.tiny_corpus(), 1024, tmp / "tok")))
    rows = []
    for i in range(items):
      track = workflow.TRACKS[i % len(workflow.TRACKS)]
      inst = FAMILIES[track].generate(i, "success")
      rows.append(RolloutItem(f"row{i}", workflow.E2E, "e2e", (
          {"role": "user", "content": inst.brief},), inst))
    plans = [[a for s in workflow.STAGES for a in expert_actions(r.instance, s)] for r in rows]

    def script(session, k):
      plan = plans[session // group]
      return chat_format.render_action(plan[k]) if k < len(plan) else "Done.\n</think>\n\nDone."
    loop = AgentLoop(ScriptedEngine(chat_format, script), chat_format,
                     task_environments(tmp / "expert", cache_dir=tmp / "cache"),
                     limits=RolloutLimits(max_response_tokens=10 ** 6, max_turn_tokens=10 ** 5),
                     concurrency=1)  # the script keys on the sessions' order of appearance
    trajs, seconds = _timed_run(loop, rows, group)
    calls = sum(t.num_tool_calls for t in trajs)
    print(f"rollout expert-script: {len(trajs)} trajectories, {calls} sandboxed calls in "
          f"{seconds:.1f}s -> {60 * len(trajs) / seconds:.1f} trajectories/min "
          f"(mean reward {np.mean([t.reward for t in trajs]):.3f})")

    if model.config.vocab_size < len(chat_format.tokenizer):
      raise ValueError("the perf model's vocab is smaller than the chat tokenizer's")
    engine = JaxEngine(model, JaxEngineConfig(num_slots=items * group, max_len=4096,
                                              prefill_chunk=512, decode_block=turn_tokens))
    loop = AgentLoop(engine, chat_format, task_environments(tmp / "policy"),
                     sampling=SamplingParams(temperature=1.0),
                     limits=RolloutLimits(max_assistant_turns=max_turns,
                                          max_turn_tokens=turn_tokens))
    loop.run(rows, group)  # compile every prefill bucket and the decode block
    trajs, seconds = _timed_run(loop, rows, group)
    tokens = sum(t.num_response_tokens for t in trajs)
    print(f"rollout tiny JAX policy: {len(trajs)} trajectories x {max_turns} turns, "
          f"{tokens} generated tokens in {seconds:.1f}s -> "
          f"{60 * len(trajs) / seconds:.1f} trajectories/min")


def _timed_run(loop, rows, group):
  """(trajectories, wall seconds) of one `AgentLoop.run`."""
  start = time.perf_counter()
  trajs = loop.run(rows, group)
  return trajs, time.perf_counter() - start


def gpu_1b(args) -> None:
  """bf16 ~1B Qwen3.5: decode tokens/s and weight-sync seconds (export + reload + swap).

  `--gpu_preset tiny` runs the same path with a small config (a CPU smoke test).
  """
  import jax
  from flax import nnx

  from bat_jax.model import ModelConfig, build_model, load_pretrained, save_pretrained
  if args.gpu_preset == "tiny":
    hf = dict(tiny_config("qwen3_5", 4), tie_word_embeddings=True)
  else:
    layers = 16
    hf = dict(
        model_type="qwen3_5_text", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(layers)],
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                         "partial_rotary_factor": 0.25})
  cfg = ModelConfig.from_hf_dict(hf, dtype="bfloat16", param_dtype="bfloat16")
  model = build_model(cfg, rngs=nnx.Rngs(0))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  prompts = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.prompt))
  from bat_jax.rollout import JaxEngine
  seconds, _ = jax_decode(model, prompts, args.new, max_len=args.prompt + args.new + 1,
                          repeats=2)
  platform = jax.devices()[0].platform
  print(f"{platform} decode: {n_params / 1e6:.1f}M params bf16, batch={args.batch} "
        f"prompt={args.prompt} new={args.new}: {args.batch * args.new / seconds:.0f} tokens/s "
        f"({seconds:.2f}s per generate incl. prefill)")
  engine = JaxEngine(model)
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    save_pretrained(model, tmp)
    t1 = time.perf_counter()
    loaded = load_pretrained(tmp)
    t2 = time.perf_counter()
    engine.update_params(loaded, "1")
    jax.block_until_ready(engine.params)
    t3 = time.perf_counter()
  print(f"{platform} weight sync: export {t1 - t0:.1f}s + load {t2 - t1:.1f}s + "
        f"swap {t3 - t2:.2f}s = {t3 - t0:.1f}s")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=64)
  parser.add_argument("--new", type=int, default=64)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--max_len", type=int, default=None,
                      help="the JAX engine's cache slots (default prompt + new + 1); the tiny "
                      "loop's is 2,048 (rollout.jax.max_len), whose attention reads only the "
                      "span its rows reach")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--items", type=int, default=2, help="rows for the rollout measurement")
  parser.add_argument("--group", type=int, default=4, help="continuations per row")
  parser.add_argument("--gpu", action="store_true", help="also the ~1B bf16 GPU measurement")
  parser.add_argument("--gpu_preset", choices=["1b", "tiny"], default="1b")
  parser.add_argument("--only_gpu", action="store_true", help="skip the CPU comparison")
  args = parser.parse_args()
  if args.only_gpu:
    gpu_1b(args)
    return

  import torch
  import transformers

  from bat_jax.model import load_pretrained
  hf_dict = tiny_config("qwen3_5", args.layers)
  torch.manual_seed(0)
  d = dict(hf_dict)
  torch_model = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(d.pop("model_type"), **d))
  prompts = np.random.RandomState(0).randint(0, hf_dict["vocab_size"], (args.batch, args.prompt))
  with tempfile.TemporaryDirectory() as weights:
    torch_model.save_pretrained(weights)
    del torch_model
    model = load_pretrained(weights)
    jax_s, jax_ids = jax_decode(model, prompts, args.new,
                                max_len=args.max_len or args.prompt + args.new + 1,
                                repeats=args.repeats)
    torch_s, torch_ids = torch_decode(weights, prompts, args.new, args.repeats)
  agree = np.mean([a == b for ja, ta in zip(jax_ids, torch_ids) for a, b in zip(ja, ta)])
  rollout_throughput(model, items=args.items, group=args.group, max_turns=3, turn_tokens=32)
  if args.gpu:
    gpu_1b(args)
  tokens = args.batch * args.new
  print(f"config: qwen3_5 layers={args.layers} batch={args.batch} prompt={args.prompt} "
        f"new={args.new} jax_max_len={args.max_len or args.prompt + args.new + 1} torch_threads={torch.get_num_threads()}; greedy tokens equal: "
        f"{100 * agree:.1f}%")
  print(f"jax engine generate: {jax_s:.3f}s {tokens / jax_s:9.0f} new tokens/s (prefill incl.)")
  print(f"torch generate:      {torch_s:.3f}s {tokens / torch_s:9.0f} new tokens/s (prefill incl.)")
  print(f"ratio jax/torch decode tokens/s: {torch_s / jax_s:.2f}")


if __name__ == "__main__":
  main()
