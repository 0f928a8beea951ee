"""`bat_jax.serve` throughput: 8 concurrent streaming OpenAI clients vs 1, and time to first token.

A random Qwen3.5-style model (hidden 256, 4 layers, the tiny test tokenizer) is saved as an HF
checkpoint and served by `python -m bat_jax.serve` in its own process, as an external harness
would see it. The same set of chat requests (greedy, streamed with the official `openai`
client, usage from `stream_options.include_usage`) is sent twice: by one client, one request at
a time, and by `--clients` clients at once. The server batches concurrent requests into shared
engine steps, so the concurrent run must produce more tokens per second. Time to first token is
measured from sending the request to the first streamed chunk after the role chunk.

The last line is the tokens/s ratio (concurrent / one client).

`--constrained` sends every request with a json_schema `response_format` (constrained decoding:
one token per engine step, each under the grammar's llguidance mask) and also times the mask
itself (fill + consume per token, in process, on the same tokenizer).

  PYTHONPATH=. python experiments/perf/serve_throughput.py --clients 8 --requests 3 --new 64
  PYTHONPATH=. python experiments/perf/serve_throughput.py ... --constrained
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def build_checkpoint(out: Path, layers: int, hidden: int) -> Path:
  from flax import nnx
  from bat_jax.model import ModelConfig, build_model, save_pretrained
  from bat_jax.model import tokenizer as tk
  from bat_jax.model import tokenizer_corpus
  tok_dir = tk.train_tokenizer(tokenizer_corpus.tiny_corpus(), 1024, out / "tok")
  vocab = len(tk.load_tokenizer(tok_dir))
  heads = hidden // 32
  cfg = ModelConfig(model_type="qwen3_5_text", vocab_size=vocab, hidden_size=hidden,
                    intermediate_size=3 * hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=2, head_dim=32,
                    layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else
                                      "linear_attention" for i in range(layers)),
                    linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
                    linear_num_value_heads=8, linear_conv_kernel_dim=4,
                    partial_rotary_factor=0.25, tie_word_embeddings=False)
  save_pretrained(build_model(cfg, rngs=nnx.Rngs(0)), out / "policy", tokenizer_dir=tok_dir)
  return out / "policy"


SCHEMA = {"type": "object", "required": ["plan", "steps"], "additionalProperties": False,
          "properties": {"plan": {"type": "string", "maxLength": 400},
                         "steps": {"type": "array", "maxItems": 16,
                                   "items": {"type": "string", "maxLength": 80}}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "plan", "schema": SCHEMA}}
EXTRA: dict = {}   # request fields of every request (--constrained: response_format)


def mask_cost_us(tok_dir: Path, tokens: int = 400) -> float:
  """Microseconds per token of the grammar's work alone: mask fill + unpack + consume."""
  from bat_jax.model import tokenizer as tk
  from bat_jax.rollout.server.grammar import TokenConstraint, response_format_grammar
  tokenizer = tk.load_tokenizer(tok_dir)
  grammar = response_format_grammar(RESPONSE_FORMAT)
  rng, spent, done = np.random.default_rng(0), 0.0, 0
  while done < tokens:
    c = TokenConstraint(grammar, tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    while not c.finished and done < tokens:
      t0 = time.perf_counter()
      allowed = np.flatnonzero(c.mask())
      pick = int(rng.choice(allowed))
      c.accept(pick)
      spent += time.perf_counter() - t0
      done += 1
  return spent / done * 1e6


def one_request(client, i: int, new: int) -> tuple[int, float]:
  """(completion tokens, seconds to the first generated chunk) of one streamed request."""
  t0 = time.perf_counter()
  ttft, tokens = None, 0
  stream = client.chat.completions.create(
      model="perf-policy", max_tokens=new, temperature=0, stream=True,
      stream_options={"include_usage": True}, **EXTRA,
      messages=[{"role": "user", "content": f"Case {i}: plan the stage and run the model."}])
  for n, chunk in enumerate(stream):
    if n == 1 and ttft is None:
      ttft = time.perf_counter() - t0
    if chunk.usage is not None:
      tokens = chunk.usage.completion_tokens
  return tokens, ttft if ttft is not None else time.perf_counter() - t0


def run(client_factory, n_clients: int, requests: int, new: int) -> tuple[float, list[float]]:
  """Tokens/s over all clients and every request's time to first token."""
  tokens, ttfts, lock = [0], [], threading.Lock()

  def worker(c: int) -> None:
    client = client_factory()
    for r in range(requests):
      n, ttft = one_request(client, c * requests + r, new)
      with lock:
        tokens[0] += n
        ttfts.append(ttft)
  threads = [threading.Thread(target=worker, args=(c,)) for c in range(n_clients)]
  t0 = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return tokens[0] / (time.perf_counter() - t0), ttfts


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--clients", type=int, default=8)
  parser.add_argument("--requests", type=int, default=3, help="per client")
  parser.add_argument("--new", type=int, default=64, help="max_tokens per request")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--stream_interval", type=int, default=16, help="tokens per step")
  parser.add_argument("--constrained", action="store_true",
                      help="json_schema response_format on every request")
  args = parser.parse_args()
  if args.constrained:
    EXTRA["response_format"] = RESPONSE_FORMAT

  import openai
  from bat_jax.rollout.sglang_launcher import ServerProcess, free_port
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = build_checkpoint(Path(tmp), args.layers, args.hidden)
    port = free_port()
    cmd = [sys.executable, "-m", "bat_jax.serve", "--model-path", str(ckpt), "--port",
           str(port), "--served-model-name", "perf-policy", "--max-running-requests",
           str(args.clients), "--context-length", "1024", "--stream-interval",
           str(args.stream_interval), "--decode-block", str(args.stream_interval)]
    with ServerProcess(cmd, f"http://127.0.0.1:{port}", Path(tmp) / "serve.log",
                       startup_timeout_s=600) as server:
      factory = lambda: openai.OpenAI(base_url=server.base_url + "/v1",  # noqa: E731
                                      api_key="unused", max_retries=0, timeout=600)
      run(factory, args.clients, 1, args.new)  # compile every shape the runs will use
      run(factory, 1, 1, args.new)
      one_tps, one_ttft = run(factory, 1, args.clients * args.requests, args.new)
      many_tps, many_ttft = run(factory, args.clients, args.requests, args.new)
    mask_us = mask_cost_us(ckpt) if args.constrained else None
  print(f"config: qwen3_5 layers={args.layers} hidden={args.hidden} max_tokens={args.new} "
        f"requests={args.clients * args.requests} stream_interval={args.stream_interval} "
        f"constrained={args.constrained}")
  if mask_us is not None:
    print(f"grammar mask (llguidance fill + consume), per token: {mask_us:.1f} us")
  for name, tps, ttft in (("1 client ", one_tps, one_ttft),
                          (f"{args.clients} clients", many_tps, many_ttft)):
    print(f"{name}: {tps:8.1f} tokens/s  time to first token median "
          f"{np.median(ttft) * 1e3:7.1f} ms  p90 {np.percentile(ttft, 90) * 1e3:7.1f} ms")
  print(f"tokens/s ratio ({args.clients} concurrent / 1 client): {many_tps / one_tps:.2f}x")


if __name__ == "__main__":
  main()
