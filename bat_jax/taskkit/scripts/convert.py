"""Converts model weights between format versions (stdlib only; shipped with every model).

Usage: python convert.py IN.json OUT.json --to VERSION

Format N stores {"format_version": N, "params": {...}}. Exports from newer trainers store the
same params JSON-encoded under "params_json"; converting rewrites them in format N.
"""
import argparse
import json
import sys

from bat_jax.taskkit.scripts.checks import atomic_write_json  # inlined


def convert(blob, target):
  if "params" in blob:
    params = blob["params"]
  elif "params_json" in blob:
    params = json.loads(blob["params_json"])
  else:
    raise ValueError("weights hold neither 'params' nor 'params_json'")
  return {"format_version": target, "params": params}


def main(argv=None):
  parser = argparse.ArgumentParser(description="convert model weights between format versions")
  parser.add_argument("src")
  parser.add_argument("dst")
  parser.add_argument("--to", type=int, required=True)
  args = parser.parse_args(argv)
  with open(args.src, encoding="utf-8") as f:
    out = convert(json.load(f), args.to)
  atomic_write_json(args.dst, out)
  print("wrote %s (format_version %d)" % (args.dst, args.to))
  return 0


if __name__ == "__main__":
  sys.exit(main())
