"""Stage tools: the short CLIs a `stage_tools` workspace ships under tools/ (stdlib only).

Each command does one stage's heavy lifting by executed code and writes the artifacts and
receipts of the public contract; its arguments carry the decisions. Values come from the brief
(weights, data folder, case count, card, validation ids, submission: short ids such as `w12`
that the spec's `ids` maps to the real path or list; the real value works too) or, for the
reactive steps, from an earlier observation (the fault and subject `validate` names):

  python tools/plan.py --weights W --data D --cases N
  python tools/setup.py --card C
  python tools/validate.py --cases V
  python tools/fix.py --fault FAULT --subject SUBJECT
  python tools/infer.py --data D            | python tools/infer.py --blocked FAULT
  python tools/submit.py --to S             | python tools/submit.py --failed FAULT --subject S

A call whose arguments do not fit the workspace exits non-zero (so it leaves no evidence) or
writes exactly what it was told, which the rubric then rejects. Exit code 0 means done.
"""
import argparse
import csv
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys

from bat_jax.taskkit.scripts.checks import atomic_write_json, atomic_write_text  # inlined
from bat_jax.taskkit.scripts.checks import degenerate, diagnose, prediction_ok  # inlined
from bat_jax.taskkit.scripts.checks import sha256_file, write_receipt  # inlined
from bat_jax.taskkit.scripts.submission import read_submission, write_submission  # inlined

SPEC = "task/spec.json"
CONFIG = "pipeline/config.json"
VALIDATION = "validation/small_case.json"
DIAGNOSIS = "validation/diagnosis.json"
CORRECTION = "validation/correction.json"
PREDICTIONS = "outputs/predictions.jsonl"
LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")


class ToolError(Exception):
  """A call that does not fit the workspace: printed, exit code 1, nothing more written."""


def _json(path):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ToolError("cannot read %s: %s" % (path, e)) from None


def _resolve(value):
  """The real path / list a short id of the spec's `ids` stands for (else `value` itself)."""
  return _json(SPEC).get("ids", {}).get(value, value) if value else value


def _short(value):
  """The short id standing for `value`, for what the tools print (else `value` itself)."""
  return {v: k for k, v in _json(SPEC).get("ids", {}).items()}.get(value, value)


def _index_ids(config):
  with open(config["index"], encoding="utf-8", newline="") as f:
    return [r["case_id"] for r in csv.DictReader(f)]


def _pipeline(out, cases=None):
  argv = [sys.executable, "pipeline/infer.py", "--out", out] + (
      ["--cases", ",".join(cases)] if cases else [])
  return subprocess.run(argv, capture_output=True, text=True)


PLAN = """# Plan: {task_id}

## Framing
Track: {track}. {objective} The provided model is run by the pipeline the setup tool installs;
results count only from executed code and receipts.

## Approach
- Preprocess: read each case of the data index and normalise intensities as the card says.
- Inference: run the model on the validation cases first, diagnose and fix any fault, then
  infer over every case.
- Postprocess: check shapes against the prediction schema ({schema}), reject degenerate
  outputs, convert predictions into the native submission format.

## Resources
- Weights `{weights}`, model card `{card}`.
- Data folder `{data}`: {cases} cases.

## Outputs
- Predictions `{predictions}` with a receipt; submission `{submission}`, or a failure report
  when the task cannot be completed honestly.
"""


def plan(args):
  spec = _json(SPEC)
  text = PLAN.format(task_id=spec["task_id"], track=spec["track"], objective=spec["objective"],
                     schema=spec["prediction_schema"]["type"], weights=_resolve(args.weights),
                     card=spec["model"]["card"], data=_resolve(args.data), cases=args.cases,
                     predictions=PREDICTIONS, submission=spec["submission"]["path"])
  atomic_write_text("plan/plan.md", text)
  print("plan/plan.md written (%d chars)" % len(text))


def setup(args):
  card_path = _resolve(args.card)
  card = _json(card_path)
  model_dir = os.path.dirname(card_path)
  modules = {m: importlib.util.find_spec(m) is not None for m in card["requires"]}
  atomic_write_json("setup/environment.json", {"python": platform.python_version(),
                                               "modules": modules, "ready": all(modules.values())})
  weights = os.path.join(model_dir, card["weights"])
  raw = open(weights, "rb").read()
  try:
    version = json.loads(raw).get("format_version")
  except ValueError:
    version = None
  supported = card["runner"]["supports_format_versions"]
  atomic_write_json("setup/compatibility.json", {"weights_format_version": version,
                                                 "runner_supports": supported,
                                                 "compatible": version in supported})
  try:
    entry = importlib.util.spec_from_file_location(
        "runner", os.path.join(model_dir, card["runner"]["entry"]))
    runner = importlib.util.module_from_spec(entry)
    entry.loader.exec_module(runner)
    runner.load_weights(weights)
    load_ok, load_error = True, None
  except Exception as e:  # the load result is a record, not a crash
    load_ok, load_error = False, "%s: %s" % (type(e).__name__, e)
  atomic_write_json("setup/checkpoint.json", {"path": weights, "sha256": sha256_file(weights),
                                              "load_ok": load_ok, "load_error": load_error})
  os.makedirs("pipeline", exist_ok=True)
  for name in ("checks.py", "infer.py", "submission.py"):
    shutil.copyfile(os.path.join(LIB, name), os.path.join("pipeline", name) + ".tmp")
    os.replace(os.path.join("pipeline", name) + ".tmp", os.path.join("pipeline", name))
  spec = _json(SPEC)
  atomic_write_json(CONFIG, {"card": card_path, "weights": weights, "exclude": [],
                             "runner": os.path.join(model_dir, card["runner"]["entry"]),
                             "data_dir": spec["data"]["dir"], "index": spec["data"]["index"],
                             "intensity_scale": card["preprocess"]["intensity_scale"]})
  missing = sorted(m for m, ok in modules.items() if not ok)
  print("setup done: missing_modules=%s compatible=%s load_ok=%s"
        % (",".join(missing) or "none", version in supported, load_ok))


def fault_line(fault, subject, recoverable):
  """What validate prints for a fault. Each value follows a space, as after its flag in the
  fix / infer / submit call that copies it: `fault=degenerate_output` splits into other tokens
  (`=`, `de`, `generate`) than ` --fault degenerate_output` (` degenerate`), so copying it meant
  respelling, which the tiny policy rarely got right (experiments/README.md, "Values after a
  space")."""
  return "fault: %s subject: %s recoverable: %s" % (fault, subject,
                                                    "yes" if recoverable else "no")


def validate(args):
  config, spec = _json(CONFIG), _json(SPEC)
  cases = [c for c in _resolve(args.cases).split(",") if c]
  unknown = sorted(set(cases) - set(_index_ids(config)))
  if not cases or unknown:
    raise ToolError("unknown case ids: %s" % (", ".join(unknown) or "(none given)"))
  _pipeline(VALIDATION, cases)
  result = _json(VALIDATION)
  schema = spec["prediction_schema"]
  found = diagnose(result, schema, config, _json(config["card"]))
  if found["fault"] is not None:
    subject = _short(found["subject"])
    if subject != found["subject"]:
      found = dict(found, subject_id=subject)
    atomic_write_json(DIAGNOSIS, found)
    print(fault_line(found["fault"], subject, found["recoverable"]))
    return
  preds = [r["prediction"] for r in result["records"] if "prediction" in r]
  checks = {"cases": sorted(r["case_id"] for r in result["records"]),
            "status": result["status"],
            "shape_ok": bool(preds) and all(prediction_ok(p, schema) for p in preds),
            "non_degenerate": bool(preds) and not degenerate(preds, schema)}
  files = [p for p in (VALIDATION, DIAGNOSIS, CORRECTION) if os.path.exists(p)]
  write_receipt("validation/receipt.json", "S3", files, checks)
  print("validation ok: %d cases, shape_ok=%s non_degenerate=%s"
        % (len(preds), checks["shape_ok"], checks["non_degenerate"]))


def fix(args):
  config = _json(CONFIG)
  args.subject = _resolve(args.subject)
  if args.fault == "corrupted_case":
    if args.subject not in _index_ids(config):
      raise ToolError("no case %r in the index" % args.subject)
    config["exclude"] = sorted(set(config["exclude"]) | {args.subject})
    changed = [CONFIG]
  elif args.fault == "version_mismatch":
    if not os.path.isfile(args.subject):
      raise ToolError("no weights file %r" % args.subject)
    card = _json(config["card"])
    target = card["runner"]["supports_format_versions"][0]
    dst = args.subject[:-len(".json")] + "_v%d.json" % target
    converter = os.path.join(os.path.dirname(config["card"]), card["converter"])
    done = subprocess.run([sys.executable, converter, args.subject, dst, "--to", str(target)],
                          capture_output=True, text=True)
    if done.returncode != 0:
      raise ToolError("conversion failed: %s" % done.stderr.strip()[-300:])
    config["weights"] = dst
    changed = [CONFIG, dst]
  elif args.fault == "degenerate_output":
    if args.subject != "intensity_scale":
      raise ToolError("degenerate_output is fixed through intensity_scale, not %r"
                      % args.subject)
    config["intensity_scale"] = "maxval"
    changed = [CONFIG]
  else:
    raise ToolError("fault %r cannot be fixed inside the sandbox" % args.fault)
  atomic_write_json(CONFIG, config)
  atomic_write_json(CORRECTION, {"fault": args.fault, "subject": args.subject,
                                 "changed": changed})
  print("fixed %s (%s); validate again" % (args.fault, args.subject))


def infer(args):
  if args.blocked:
    diagnosis = _json(DIAGNOSIS) if os.path.exists(DIAGNOSIS) else {}
    write_receipt("outputs/receipt.json", "S4", [], {
        "status": "blocked", "fault": args.blocked, "subject": diagnosis.get("subject"),
        "predictions_written": False})
    print("inference blocked by %s; no predictions written" % args.blocked)
    return
  config = _json(CONFIG)
  args.data = _resolve(args.data)
  if not args.data or os.path.normpath(args.data) != os.path.normpath(config["data_dir"]):
    raise ToolError("--data %r is not the pipeline's data folder" % args.data)
  run = _pipeline(PREDICTIONS)
  if run.returncode == 1:
    raise ToolError("the model failed to load: %s" % run.stdout.strip()[-300:])
  expected = sorted(c for c in _index_ids(config) if c not in config["exclude"])
  records = [json.loads(line) for line in open(PREDICTIONS) if line.strip()]
  predicted = sorted(r["case_id"] for r in records if "prediction" in r)
  schema = _json(SPEC)["prediction_schema"]
  checks = {"expected": len(expected), "predicted": len(predicted),
            "missing": sorted(set(expected) - set(predicted)), "excluded": config["exclude"],
            "shape_ok": all(prediction_ok(r["prediction"], schema) for r in records
                            if "prediction" in r)}
  write_receipt("outputs/receipt.json", "S4", [PREDICTIONS], checks)
  print("predicted %d of %d cases, missing=%s" % (len(predicted), len(expected),
                                                  ",".join(checks["missing"]) or "none"))
  if checks["missing"] or not checks["shape_ok"]:
    raise ToolError("coverage check failed")


def _handed_files():
  return sorted(os.path.join(d, f).replace(os.sep, "/") for d, _, fs in os.walk("submission")
                for f in fs if f != "receipt.json")


def submit(args):
  if args.failed:
    diagnosis = _json(DIAGNOSIS) if os.path.exists(DIAGNOSIS) else {}
    report = {"status": "failed", "fault": args.failed, "subject": _resolve(args.subject),
              "reason": diagnosis.get("evidence", ""), "predictions_submitted": 0}
    atomic_write_json("submission/failure_report.json", report)
    write_receipt("submission/receipt.json", "S5", _handed_files(),
                  {"status": "failed", "fault": args.failed})
    print("failure report handed off: %s (%s)" % (args.failed, args.subject))
    return
  args.to = _resolve(args.to)
  if not args.to or not os.path.normpath(args.to).startswith("submission" + os.sep):
    raise ToolError("--to must be a path under submission/, got %r" % args.to)
  spec, config = _json(SPEC), _json(CONFIG)
  target = dict(spec["submission"], path=args.to)
  records = [json.loads(line) for line in open(PREDICTIONS) if line.strip()]
  write_submission(target, {r["case_id"]: r["prediction"] for r in records if "prediction" in r})
  submitted = read_submission(target)
  expected = sorted(c for c in _index_ids(config) if c not in config["exclude"])
  checks = {"schema_ok": True, "cases": len(submitted),
            "missing": sorted(set(expected) - set(submitted)),
            "unexpected": sorted(set(submitted) - set(expected))}
  write_receipt("submission/receipt.json", "S5", _handed_files(), checks)
  print("submitted %d cases to %s, missing=%s" % (len(submitted), args.to,
                                                  ",".join(checks["missing"]) or "none"))


def _parser(command):
  p = argparse.ArgumentParser(prog="tools/%s.py" % command)
  if command == "plan":
    p.add_argument("--weights", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--cases", required=True, type=int)
  elif command == "setup":
    p.add_argument("--card", required=True)
  elif command == "validate":
    p.add_argument("--cases", required=True)
  elif command == "fix":
    p.add_argument("--fault", required=True)
    p.add_argument("--subject", required=True)
  elif command == "infer":
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--data")
    g.add_argument("--blocked")
  elif command == "submit":
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--to")
    g.add_argument("--failed")
    p.add_argument("--subject")
  return p


COMMANDS = {"plan": plan, "setup": setup, "validate": validate, "fix": fix, "infer": infer,
            "submit": submit}


def main(command, argv=None):
  args = _parser(command).parse_args(argv)
  if command == "submit" and args.failed and not args.subject:
    print("error: --failed needs --subject")
    return 2
  try:
    COMMANDS[command](args)
  except ToolError as e:
    print("error: %s" % e)
    return 1
  return 0
