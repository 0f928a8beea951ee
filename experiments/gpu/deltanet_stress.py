"""DeltaNet stress cases: the chunked kernel against an exact float64 recurrence.

Runs every adversarial case of tests/model/deltanet_cases.py (similar / identical keys, beta -> 1,
slow, zero and strong decay, long padding, lengths around the 64-token chunk) through
`gated_delta_rule_chunked` with fp32 and with bf16 inputs, and the token-by-token
`gated_delta_rule_recurrent`, on the default backend, and prints the max abs error of each
against float64 NumPy. `--compare=PATH` also runs the `deltanet.py` at PATH (e.g. an older
checkout's kernel) for a before/after column. Last line: the worst fp32 chunked error.

  PYTHONPATH=. python experiments/gpu/deltanet_stress.py [--cases=a,b] [--json=out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "model"))
from deltanet_cases import CASES, make_inputs, reference_recurrence  # noqa: E402

from bat_jax.model import deltanet  # noqa: E402

ARGS = ("q", "k", "v", "g", "beta", "state")
TOL = 1e-4


def load_kernel_module(path: str):
  spec = importlib.util.spec_from_file_location("deltanet_compare", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def max_err(got, want) -> float:
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  if not np.isfinite(got).all():
    return float("inf")
  return float(np.abs(got - want).max())


def run_case(name: str, modules: dict) -> dict[str, float]:
  inputs = make_inputs(CASES[name])
  want_out, want_state = reference_recurrence(*(inputs[a] for a in ARGS))
  bf16 = {a: jnp.asarray(inputs[a], jnp.bfloat16) for a in ARGS}
  rounded = (np.asarray(bf16[a].astype(jnp.float32)) for a in ARGS)
  want_bf16, want_bf16_state = reference_recurrence(*rounded)
  row = {}
  with jax.default_matmul_precision("highest"):
    for label, module in modules.items():
      chunked = jax.jit(module.gated_delta_rule_chunked, static_argnames="chunk_size")
      out, state = chunked(*(inputs[a] for a in ARGS), chunk_size=64)
      row[f"{label} fp32"] = max(max_err(out, want_out), max_err(state, want_state))
      if label == "new":
        out, state = chunked(*bf16.values(), chunk_size=64)
        row["new bf16-in"] = max(max_err(out, want_bf16), max_err(state, want_bf16_state))
        out, _ = jax.jit(module.gated_delta_rule_recurrent)(*(inputs[a] for a in ARGS))
        row["recurrent fp32"] = max_err(out, want_out)
  return row


def time_kernels(modules: dict, batch: int, seq: int, heads: int, rounds: int = 3
                 ) -> dict[str, float]:
  """Best seconds of one chunked forward + backward at a training-like shape, per module; the
  modules alternate within each round so machine load hits them alike."""
  key = jax.random.split(jax.random.key(0), 5)
  unit = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True))
  q = unit(jax.random.normal(key[0], (batch, seq, heads, 128))) * 128 ** -0.5
  k = unit(jax.random.normal(key[1], (batch, seq, heads, 128)))
  v = jax.random.normal(key[2], (batch, seq, heads, 128), jnp.bfloat16)
  g = -0.01 * jnp.ones((batch, seq, heads))
  beta = jax.nn.sigmoid(jax.random.normal(key[4], (batch, seq, heads)))
  s0 = jnp.zeros((batch, heads, 128, 128))
  steps = {}
  for label, module in modules.items():
    loss = lambda *a, m=module: jnp.sum(m.gated_delta_rule_chunked(*a, chunk_size=64)[0])
    steps[label] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(steps[label](q, k, v, g, beta, s0))  # compile
  best = {label: float("inf") for label in modules}
  for _ in range(rounds):
    for label, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step(q, k, v, g, beta, s0))
      best[label] = min(best[label], time.perf_counter() - start)
  return best


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--compare", default=None, help="another deltanet.py for a before column")
  parser.add_argument("--time", default="", help="B,T,H of a fwd+bwd timing (e.g. 8,4096,32)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  modules = {"new": deltanet}
  if args.compare:
    modules = {"old": load_kernel_module(args.compare), **modules}
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
  rows = {}
  for name in args.cases.split(","):
    rows[name] = run_case(name, modules)
    print(f"{name:<30}" + "  ".join(f"{k} {v:.2e}" for k, v in rows[name].items()), flush=True)
  worst = max(r["new fp32"] for r in rows.values())
  worst_bf16 = max(r["new bf16-in"] for r in rows.values())
  result = {"cases": rows, "worst_fp32": worst, "worst_bf16_inputs": worst_bf16,
            "pass": bool(worst <= TOL and worst_bf16 <= TOL)}
  if args.time:
    b, t, h = (int(x) for x in args.time.split(","))
    result["fwd_bwd_seconds"] = time_kernels(modules, b, t, h)
    for label, seconds in result["fwd_bwd_seconds"].items():
      print(f"{label} chunked fwd+bwd B={b} T={t} H={h} Dk=Dv=128: {seconds:.4f} s")
    if "old" in modules:
      times = result["fwd_bwd_seconds"]
      print(f"new/old fwd+bwd time: {times['new'] / times['old']:.2f}")
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
  print(f"deltanet stress: worst fp32 {worst:.2e}, worst bf16-input {worst_bf16:.2e} "
        f"(tolerance {TOL:g}): {'PASS' if result['pass'] else 'FAIL'}")


if __name__ == "__main__":
  main()
