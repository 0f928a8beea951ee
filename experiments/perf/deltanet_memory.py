"""Compiled temp memory of one GatedDeltaNet layer fwd+bwd vs sequence length.

Abstract params and inputs (nothing allocated); AOT compile on one CPU device.
Prints temp bytes per T and the per-token slope, next to the memory-optimal
estimate: activations O(T * H * (Dk + Dv)) plus one fp32 [H, Dk, Dv] state per
64-token chunk. Usage:

  python experiments/perf/deltanet_memory.py [--dtype=bfloat16] [--tokens=1024,2048,4096,8192]
      [--top=8]   # print the largest buffers of the longest T's HLO
  python experiments/perf/deltanet_memory.py --remat_check   # does this backend keep remat?
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from flax import nnx

from bat_jax.model.deltanet import GatedDeltaNet
from bat_jax.model.remat import recompute_vjp

GIB = 1024 ** 3


def layer_grad_fn(dtype, hidden=4096, k_heads=16, v_heads=32, head_dim=128, chunk=64):
  """(graphdef, abstract params, fn(params, x) -> grads) for one 9B-width layer."""
  def build():
    return GatedDeltaNet(hidden_size=hidden, num_k_heads=k_heads, num_v_heads=v_heads,
                         head_k_dim=head_dim, head_v_dim=head_dim, conv_kernel=4, eps=1e-6,
                         chunk_size=chunk, dtype=dtype, param_dtype=jnp.float32,
                         rngs=nnx.Rngs(0))
  abstract = nnx.eval_shape(build)
  graphdef, params = nnx.split(abstract)

  def loss(p, x):
    layer = nnx.merge(graphdef, p)
    out, _ = layer(x, valid=jnp.ones(x.shape[:2], bool))
    return jnp.sum(out.astype(jnp.float32) ** 2)

  return params, jax.grad(loss, argnums=(0, 1))


def compiled_temp(tokens: int, dtype, **widths):
  params, grad = layer_grad_fn(dtype, **widths)
  hidden = widths.get("hidden", 4096)
  x = jax.ShapeDtypeStruct((1, tokens, hidden), dtype)
  compiled = jax.jit(grad).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes, compiled


def largest_buffers(compiled, top: int):
  """Largest array shapes in the optimized HLO (a proxy for what dominates temp)."""
  sizes = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "f64": 8, "u32": 4, "s8": 1}
  found = {}
  for m in re.finditer(r"\b(f32|bf16|s32|pred|f64)\[([0-9,]+)\]", compiled.as_text()):
    dims = [int(d) for d in m.group(2).split(",")]
    n = sizes[m.group(1)]
    for d in dims:
      n *= d
    found[f"{m.group(1)}[{m.group(2)}]"] = n
  return sorted(found.items(), key=lambda kv: -kv[1])[:top]


def remat_check(layers: int = 4, tokens: int = 8192, width: int = 1024):
  """Temp of `layers` toy MLP layers rematerialised the way the model does it (full remat is
  `bat_jax.model.remat.recompute_vjp`, see `decoder._rematerialise`) vs not at all, and whether
  the compiled HLO still recomputes (tanh count)."""
  def layer(w, x):
    h = jnp.tanh(x @ w[0])
    return x + jnp.tanh(h @ w[1]) @ w[2]
  for remat in (True, False):
    f = recompute_vjp(layer, wait_argnum=1) if remat else layer  # x (argnum 1) is the activation

    def loss(ws, x, f=f):
      for w in ws:
        x = f(w, x)
      return jnp.sum(x ** 2)
    ws = [jax.ShapeDtypeStruct((3, width, width), jnp.float32)] * layers
    lowered = jax.jit(jax.grad(loss)).lower(ws, jax.ShapeDtypeStruct((tokens, width), jnp.float32))
    compiled = lowered.compile()
    text = compiled.as_text()
    print(f"remat {'on ' if remat else 'off'}: temp "
          f"{compiled.memory_analysis().temp_size_in_bytes / 2**20:7.1f} MiB, "
          f"tanh {text.count(' tanh(')} (forward only: {2 * layers}, recomputed: {4 * layers})")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--tokens", default="1024,2048,4096,8192")
  ap.add_argument("--top", type=int, default=0)
  ap.add_argument("--remat_check", action="store_true")
  args = ap.parse_args()
  if args.remat_check:
    return remat_check()
  dtype = jnp.dtype(args.dtype)
  tokens = [int(t) for t in args.tokens.split(",")]
  h, dk, dv, chunk = 32, 128, 128, 64
  print(f"one GatedDeltaNet layer fwd+bwd, 9B widths, B=1, compute {dtype.name}, "
        f"{jax.devices()[0].platform}")
  temps = []
  for t in tokens:
    temp, compiled = compiled_temp(t, dtype)
    temps.append(temp)
    optimal = t * h * (dk + dv) * 4 * 8 + (t // chunk) * h * dk * dv * 4
    print(f"T={t:6d}  temp {temp / GIB:7.3f} GiB  ({temp / t / 1024:8.1f} KiB/token)  "
          f"rough optimum {optimal / GIB:6.3f} GiB")
  if len(tokens) > 1:
    slope = (temps[-1] - temps[0]) / (tokens[-1] - tokens[0])
    print(f"slope {slope / 1024:.1f} KiB/token = {slope * 1000 / GIB:.3f} GiB per 1,000 tokens")
  if args.top:
    for shape, n in largest_buffers(compiled, args.top):
      print(f"  {n / 2**20:9.1f} MiB  {shape}")


if __name__ == "__main__":
  main()
