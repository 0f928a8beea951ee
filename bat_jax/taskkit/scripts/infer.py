"""Pipeline: run the provided model over the cases of the data index (stdlib only).

Usage:
  python pipeline/infer.py --out validation/small_case.json --cases ID1,ID2
  python pipeline/infer.py --out outputs/predictions.jsonl

Reads pipeline/config.json ({card, runner, weights, data_dir, index, intensity_scale, exclude}).
A .json output holds {status, error?, records}; a .jsonl output holds one record per line. A
record is {case_id, prediction} or {case_id, error}. Exit code: 0 ok, 1 model failed to load,
2 some cases failed.
"""
import argparse
import csv
import importlib.util
import json
import sys

from bat_jax.taskkit.scripts.checks import atomic_write_text  # inlined

CONFIG = "pipeline/config.json"


def load_runner(path):
  spec = importlib.util.spec_from_file_location("model_runner", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def write_output(path, result):
  if path.endswith(".jsonl"):
    lines = [json.dumps(r, sort_keys=True) + "\n" for r in result["records"]]
    atomic_write_text(path, "".join(lines))
  else:
    atomic_write_text(path, json.dumps(result, sort_keys=True) + "\n")


def main(argv=None):
  parser = argparse.ArgumentParser(description="run the provided model over the data index")
  parser.add_argument("--out", required=True)
  parser.add_argument("--cases", default="", help="comma-separated case ids (default: all)")
  args = parser.parse_args(argv)
  with open(CONFIG, encoding="utf-8") as f:
    config = json.load(f)
  with open(config["index"], encoding="utf-8", newline="") as f:
    rows = list(csv.DictReader(f))
  wanted = set(args.cases.split(",")) if args.cases else {r["case_id"] for r in rows}
  unknown = wanted - {r["case_id"] for r in rows}
  if unknown:
    raise SystemExit("unknown case ids: %s" % ", ".join(sorted(unknown)))
  rows = [r for r in rows if r["case_id"] in wanted and r["case_id"] not in config["exclude"]]
  result = {"status": "ok", "records": []}
  try:
    runner = load_runner(config["runner"])
    params = runner.load_weights(config["weights"])
  except Exception as e:  # report any load failure as data, for diagnosis
    result.update(status="failed", error="%s: %s" % (type(e).__name__, e))
    write_output(args.out, result)
    print("model failed to load:", result["error"])
    return 1
  scale = config["intensity_scale"]
  scale = None if scale == "maxval" else float(scale)
  for row in rows:
    try:
      pred = runner.predict(params, row, config["data_dir"], scale)
      result["records"].append({"case_id": row["case_id"], "prediction": pred})
    except Exception as e:  # one bad case must not hide the others
      result["records"].append({"case_id": row["case_id"],
                                "error": "%s: %s" % (type(e).__name__, e)})
  failed = [r["case_id"] for r in result["records"] if "error" in r]
  if failed:
    result["status"] = "partial"
  write_output(args.out, result)
  print("%d cases, %d failed%s -> %s" % (len(rows), len(failed),
                                        (": " + ", ".join(failed)) if failed else "", args.out))
  return 2 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
