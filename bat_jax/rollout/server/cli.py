"""Command line of `python -m bat_jax.serve`: its own flags and `sglang.launch_server`'s.

The rollout launcher can start this server in place of SGLang with the same flags, so SGLang's
names are accepted where they apply (`--model-path`, `--served-model-name`, `--dtype`,
`--context-length`, `--mem-fraction-static`, `--random-seed`, `--skip-tokenizer-init`, ...);
flags that cannot apply to one in-process JAX engine (`--tp-size 2`) are refused by name.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from bat_jax.rollout.jax_engine import JaxEngine, JaxEngineConfig
from bat_jax.rollout.server.app import ServeApp, ServedModel
from bat_jax.rollout.server.http import make_server

log = logging.getLogger("bat_jax.serve")

DTYPES = {"auto": None, "bfloat16": "bfloat16", "float16": "float16", "half": "float16",
          "float32": "float32", "float": "float32"}


def load_served_model(checkpoint: str, config: JaxEngineConfig, *, dtype: Optional[str] = None,
                      weight_version: str = "0", served_name: Optional[str] = None,
                      skip_tokenizer: bool = False, tokenizer_path: Optional[str] = None
                      ) -> ServedModel:
  """Loads an HF checkpoint dir (weights + config, tokenizer files if present)."""
  from flax import nnx
  from bat_jax.model import load_pretrained
  path = Path(checkpoint)
  if not path.is_dir():
    raise FileNotFoundError(f"--model-path {checkpoint!r} is not a directory")
  load = lambda p: load_pretrained(p, dtype=dtype, param_dtype=dtype)  # noqa: E731
  model = load(str(path))
  tokenizer = chat_format = None
  tok_dir = Path(tokenizer_path or path)
  if skip_tokenizer:
    log.info("--skip-tokenizer-init: /generate needs input_ids and chat is off")
  elif (tok_dir / "tokenizer.json").is_file():
    from bat_jax.model import compact_chat
    from bat_jax.model.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(tok_dir)
    preamble = compact_chat.recorded_preamble(tok_dir)  # the format the policy trained on
    chat_format = compact_chat.chat_format_for(preamble, model.config.model_type, tokenizer)
    log.info("chat format: %s family, %s tool preamble (%s)", chat_format.family, preamble,
             tok_dir / "tokenizer_config.json")
  else:
    log.warning("%s has no tokenizer.json: /generate needs input_ids and chat is off", tok_dir)
  engine = JaxEngine(model, config, weight_version=weight_version)
  return ServedModel(engine=engine, model_path=str(path), load=load, tokenizer=tokenizer,
                     chat_format=chat_format, graphdef=nnx.split(model)[0],
                     served_name=served_name)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m bat_jax.serve",
                              description="SGLang-protocol and OpenAI-compatible server over "
                                          "the JAX engine")
  p.add_argument("--checkpoint", "--model-path", dest="checkpoint", required=True,
                 help="HF checkpoint directory")
  p.add_argument("--tokenizer-path", default=None, help="default: the checkpoint directory")
  p.add_argument("--served-model-name", default=None,
                 help="model name for /v1/models and requests (default: the folder's name)")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=30000)
  p.add_argument("--num-slots", "--max-running-requests", dest="num_slots", type=int,
                 default=8, help="concurrent sequences")
  p.add_argument("--max-len", "--context-length", dest="max_len", type=int, default=4096,
                 help="tokens per sequence (prompt + generation)")
  p.add_argument("--prefill-chunk", "--chunked-prefill-size", dest="prefill_chunk", type=int,
                 default=128)
  p.add_argument("--decode-block", type=int, default=64)
  p.add_argument("--stream-interval", type=int, default=16,
                 help="new tokens per scheduler step: streaming granularity, and how often "
                      "new requests can join running ones")
  p.add_argument("--dtype", default="auto", choices=sorted(DTYPES))
  p.add_argument("--random-seed", type=int, default=0)
  p.add_argument("--mem-fraction-static", type=float, default=None,
                 help="sets XLA_PYTHON_CLIENT_MEM_FRACTION unless it is already set")
  p.add_argument("--tp-size", type=int, default=1)
  p.add_argument("--dp-size", type=int, default=1)
  p.add_argument("--skip-tokenizer-init", action="store_true")
  p.add_argument("--trust-remote-code", action="store_true", help="accepted; no effect")
  p.add_argument("--enable-memory-saver", action="store_true",
                 help="accepted; memory release always works")
  p.add_argument("--weight-version", default="0")
  p.add_argument("--max-body-mb", type=float, default=16.0, help="request body cap (413)")
  p.add_argument("--body-timeout-s", type=float, default=1.0,
                 help="a request body silent this long is answered 408")
  p.add_argument("--api-key", default=os.environ.get("BAT_JAX_API_KEY"),
                 help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                      "(admin endpoints included); default $BAT_JAX_API_KEY")
  p.add_argument("--max-connections", type=int, default=64,
                 help="connections served at once; more wait in the listen queue")
  p.add_argument("--header-timeout-s", type=float, default=5.0,
                 help="a client that has not sent its request headers by then is dropped")
  p.add_argument("--log-level", default="INFO")
  return p


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  if not Path(args.checkpoint).is_dir():
    parser.error(f"--checkpoint / --model-path {args.checkpoint!r} is not a directory")
  for flag in ("tp_size", "dp_size"):
    if getattr(args, flag) != 1:
      parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: bat_jax.serve runs one "
                   "engine in one process; start one server per device group instead")
  if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static <= 1:
    parser.error(f"--mem-fraction-static {args.mem_fraction_static} is not in (0, 1]")
  for flag in ("num_slots", "max_len", "prefill_chunk", "decode_block", "stream_interval"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')} must be >= 1")
  if not 1 <= args.max_connections <= 4096 or not 0 < args.header_timeout_s <= 600:
    parser.error("--max-connections must be in [1, 4096] and --header-timeout-s in (0, 600]")
  if not 0 < args.max_body_mb <= 1024 or not 0 < args.body_timeout_s <= 600:
    parser.error("--max-body-mb must be in (0, 1024] and --body-timeout-s in (0, 600]")


def main(argv: Optional[list[str]] = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  _check(parser, args)
  logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  if args.mem_fraction_static is not None:  # read when JAX first touches a device
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.mem_fraction_static))
  config = JaxEngineConfig(num_slots=args.num_slots, max_len=args.max_len,
                           prefill_chunk=args.prefill_chunk, decode_block=args.decode_block,
                           seed=args.random_seed)
  served = load_served_model(args.checkpoint, config, dtype=DTYPES[args.dtype],
                             weight_version=args.weight_version,
                             served_name=args.served_model_name,
                             skip_tokenizer=args.skip_tokenizer_init,
                             tokenizer_path=args.tokenizer_path)
  app = ServeApp(served, step_tokens=args.stream_interval, api_key=args.api_key)
  server = make_server(app, args.host, args.port, max_body_bytes=int(args.max_body_mb * 2**20),
                       body_timeout_s=args.body_timeout_s, max_connections=args.max_connections,
                       header_timeout_s=args.header_timeout_s)
  log.info("serving %s as %r on http://%s:%d", args.checkpoint, served.name, args.host,
           args.port)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
    app.close()
  return 0


def interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt  # SIGTERM shuts down like Ctrl-C: close the socket, stop the engine
