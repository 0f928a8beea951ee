"""Forward+backward tokens/s: bat_jax (Flax NNX, jit) vs transformers (PyTorch), same run.

Both models hold the same random weights (the PyTorch model is exported to HF
safetensors and loaded with `bat_jax.model.load_pretrained`), see the same
batch and compute the same next-token cross-entropy; the backward pass
produces gradients for every parameter. `--attention-impl` picks the JAX
softmax-attention kernel; the compiled step's XLA temp memory is printed too
(long `--seq` shows dense [B, H, T, T] attention vs chunked). The last line is
the ratio.

  PYTHONPATH=. python experiments/perf/model_fwd_bwd.py --family qwen3_5 --batch 4 --seq 256
  PYTHONPATH=. python experiments/perf/model_fwd_bwd.py --family qwen3 --batch 1 --seq 4096 \
      --attention-impl chunked
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import transformers
from flax import nnx

from bat_jax.model import load_pretrained
from bat_jax.model.decoder import with_attention_impl


def tiny_config(family: str, layers: int) -> dict:
  common = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=32768, tie_word_embeddings=False)
  if family == "qwen3":
    return dict(model_type="qwen3", rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                **common)
  layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                 for i in range(layers)]
  return dict(model_type="qwen3_5_text", layer_types=layer_types,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                               "partial_rotary_factor": 0.25},
              linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
              linear_num_key_heads=4, linear_num_value_heads=8, **common)


def time_it(fn, iters: int) -> float:
  fn()  # warm-up / compile
  fn()
  start = time.perf_counter()
  for _ in range(iters):
    fn()
  return (time.perf_counter() - start) / iters


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--family", choices=["qwen3", "qwen3_5"], default="qwen3_5")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--attention-impl", choices=["auto", "xla", "cudnn", "chunked"],
                      default="auto")
  parser.add_argument("--attention-block", type=int, default=512)
  args = parser.parse_args()

  hf_dict = tiny_config(args.family, args.layers)
  torch.manual_seed(0)
  d = dict(hf_dict)
  hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
  torch_model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().train()
  with tempfile.TemporaryDirectory() as tmp:
    torch_model.save_pretrained(Path(tmp))
    model = load_pretrained(tmp)
  impl = None if args.attention_impl == "auto" else args.attention_impl
  model = with_attention_impl(model, impl, block_size=args.attention_block)
  graphdef, params = nnx.split(model, nnx.Param)

  ids_np = np.random.RandomState(0).randint(0, hf_dict["vocab_size"], (args.batch, args.seq))
  ids = jnp.asarray(ids_np, jnp.int32)

  @jax.jit
  def jax_step(params, ids):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p)(ids[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    return jax.value_and_grad(loss_fn)(params)

  t_ids = torch.as_tensor(ids_np, dtype=torch.long)

  def torch_step():
    torch_model.zero_grad(set_to_none=True)
    logits = torch_model(input_ids=t_ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             t_ids[:, 1:].reshape(-1))
    loss.backward()
    return loss

  temp_bytes = jax_step.lower(params, ids).compile().memory_analysis().temp_size_in_bytes
  jax_loss, _ = jax_step(params, ids)
  torch_loss = torch_step()
  print(f"loss jax={float(jax_loss):.6f} torch={float(torch_loss):.6f}")

  tokens = args.batch * (args.seq - 1)
  jax_s = time_it(lambda: jax.block_until_ready(jax_step(params, ids)), args.iters)
  torch_s = time_it(torch_step, args.iters)
  print(f"config: family={args.family} layers={args.layers} batch={args.batch} seq={args.seq} "
        f"attention_impl={args.attention_impl} block={args.attention_block} "
        f"jax_devices={jax.devices()[0].platform} torch_threads={torch.get_num_threads()}")
  print(f"jax compiled fwd+bwd temp memory: {temp_bytes / 2**20:.1f} MiB")
  print(f"jax   fwd+bwd: {jax_s * 1e3:8.1f} ms/step  {tokens / jax_s:10.0f} tokens/s")
  print(f"torch fwd+bwd: {torch_s * 1e3:8.1f} ms/step  {tokens / torch_s:10.0f} tokens/s")
  print(f"ratio jax/torch tokens/s: {torch_s / jax_s:.2f}")


if __name__ == "__main__":
  main()
