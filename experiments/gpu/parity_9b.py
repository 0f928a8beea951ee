"""Logit parity at the Qwen3.5-9B widths (4 layers, slow-decay DeltaNet heads) vs transformers.

Builds the real-layout checkpoint of tests/model/test_deltanet_9b_pattern.py (full intermediate
size; `--vocab` is reduced from 248,320 to keep the checkpoint small), saves it as safetensors,
loads it through `bat_jax.model.load_pretrained` and compares, on 2 rows (a run of identical
tokens; random tokens), past one 64-token chunk:

* fp32: bat_jax (highest matmul precision) vs transformers fp32 (TF32 off); bound 1e-4.
* bf16: bat_jax bf16 compute (fp32 params) and transformers in bf16, each against the fp32
  transformers logits; bat_jax's error must stay within 2x of transformers' own bf16 error.
* padding: real-token logprobs of 40 tokens followed by `--pad` pad tokens equal the unpadded
  ones (fp32, bound 1e-5), in bf16 too (reported).

`--cpu-smoke` runs the same path at tiny widths on CPU (checks the script, not the numbers).

  PYTHONPATH=. python experiments/gpu/parity_9b.py [--cpu-smoke] [--json=out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "model"))
from hf_fixtures import qwen3_5_multimodal_config  # noqa: E402
from test_deltanet_9b_pattern import nine_b_pattern, slow_decay_model  # noqa: E402

from bat_jax.grpo.logprobs import taken_token_logprobs  # noqa: E402
from bat_jax.model import load_pretrained  # noqa: E402


def torch_logits(model, ids: np.ndarray, device: str, dtype) -> np.ndarray:
  model = model.to(device=device, dtype=dtype)
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(ids, dtype=torch.long, device=device)).logits
  return out.float().cpu().numpy()


@nnx.jit
def _logits(model, ids):
  return model(ids)


@nnx.jit
def _logprobs(model, ids, valid):
  return taken_token_logprobs(model, ids, valid=valid, chunk_size=32)[0]


def pad_check(model, real: np.ndarray, pad: int) -> float:
  """Max |padded - unpadded| real-token logprob (inf when anything is non-finite)."""
  alone = np.asarray(_logprobs(model, jnp.asarray(real[None]), jnp.ones((1, len(real)), bool)))
  ids = np.concatenate([real, np.zeros(pad, np.int32)])[None]
  padded = np.asarray(_logprobs(model, jnp.asarray(ids), jnp.asarray(np.arange(ids.shape[1])
                                                                     < len(real))[None]))
  if not (np.isfinite(padded).all() and np.all(padded[:, len(real):] == 0.0)):
    return float("inf")
  return float(np.abs(padded[:, :len(real)] - alone).max())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab", type=int, default=32768)
  parser.add_argument("--intermediate", type=int, default=12288)
  parser.add_argument("--tokens", type=int, default=200)
  parser.add_argument("--pad", type=int, default=1000)
  parser.add_argument("--cpu-smoke", action="store_true")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  device = "cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
  if args.cpu_smoke:
    hf = qwen3_5_multimodal_config(vocab_size=97, num_hidden_layers=4)
    args.vocab, args.tokens, args.pad = 97, 70, 100
  else:
    hf = nine_b_pattern(vocab_size=args.vocab, intermediate_size=args.intermediate)
  t0 = time.perf_counter()
  torch_model = slow_decay_model(hf)
  rng = np.random.default_rng(0)
  ids = np.stack([np.full(args.tokens, 7), rng.integers(0, args.vocab, args.tokens)])
  ids = ids.astype(np.int32)
  result: dict = {"device": device, "jax_backend": jax.default_backend(),
                  "versions": {"jax": jax.__version__, "torch": torch.__version__}}
  with tempfile.TemporaryDirectory() as tmp:
    torch_model.save_pretrained(tmp)
    ref = torch_logits(torch_model, ids, device, torch.float32)
    ref_bf16 = torch_logits(torch_model, ids, device, torch.bfloat16)
    del torch_model
    if device == "cuda":
      torch.cuda.empty_cache()
    with jax.default_matmul_precision("highest"):
      model = load_pretrained(tmp)
      got = np.asarray(_logits(model, jnp.asarray(ids)))
      real = rng.integers(1, args.vocab, 40).astype(np.int32)
      result["pad_fp32"] = pad_check(model, real, args.pad)
    del model
    model_bf16 = load_pretrained(tmp, dtype=jnp.bfloat16)
    got_bf16 = np.asarray(_logits(model_bf16, jnp.asarray(ids)))
    result["pad_bf16"] = pad_check(model_bf16, real, args.pad)
  err = lambda a: [float(np.abs(a[i] - ref[i]).max()) if np.isfinite(a[i]).all()
                   else float("inf") for i in range(2)]
  result.update(fp32_identical_random=err(got), bf16_jax_identical_random=err(got_bf16),
                bf16_torch_identical_random=err(ref_bf16), seconds=time.perf_counter() - t0)
  result["pass"] = bool(max(result["fp32_identical_random"]) <= 1e-4
                        and result["pad_fp32"] <= 1e-5
                        and all(j <= 2 * t + 1e-3 for j, t in
                                zip(result["bf16_jax_identical_random"],
                                    result["bf16_torch_identical_random"])))
  for key, value in result.items():
    print(f"{key}: {value}")
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
  print(f"9b-pattern parity: fp32 max {max(result['fp32_identical_random']):.2e} "
        f"(identical/random rows {result['fp32_identical_random']}), bf16 jax "
        f"{result['bf16_jax_identical_random']} vs torch bf16 "
        f"{result['bf16_torch_identical_random']}, pad fp32 {result['pad_fp32']:.2e}: "
        f"{'PASS' if result['pass'] else 'FAIL'}")


if __name__ == "__main__":
  main()
