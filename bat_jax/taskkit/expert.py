"""The expert solver: each stage's actions as model-neutral `execute_code` calls.

Actions are fixed given the task (a teacher demonstration, not a reactive agent), but every
value they act on is read from the workspace at run time, and the fix in S3 is the one the
diagnosis names. An Action is {"name": "execute_code", "arguments": {"language", "code"},
"thought"}.
"""

from __future__ import annotations

import json
from typing import Any

from bat_jax import workflow
from bat_jax.taskkit import toolspace
from bat_jax.taskkit.base import TaskInstance
from bat_jax.taskkit.pipeline_files import pipeline_sources

Action = dict[str, Any]
A = workflow.ARTIFACTS

# Preamble of every python action after S2: the helpers the expert shipped into pipeline/.
_PRELUDE = """import csv, json, os, sys
sys.path.insert(0, "pipeline")
from checks import atomic_write_json, degenerate, diagnose, prediction_ok, write_receipt
spec = json.load(open("task/spec.json"))
config = json.load(open("pipeline/config.json"))
schema = spec["prediction_schema"]
"""


def _act(language: str, code: str, thought: str) -> Action:
  if language not in workflow.TOOL_LANGUAGES:
    raise ValueError(f"unknown tool language {language!r}; expected {workflow.TOOL_LANGUAGES}")
  return {"name": workflow.TOOL_NAME, "arguments": {"language": language, "code": code},
          "thought": thought}


def _plan_text(inst: TaskInstance) -> str:
  spec, hidden = inst.spec, inst.hidden
  card = json.loads(inst.files[spec["model"]["card"]])
  model_dir = spec["model"]["card"].rsplit("/", 1)[0]
  sub = spec["submission"]
  return f"""# Plan: {spec['task_id']}

## Framing
Track: {inst.track}. {spec['objective']} The provided model `{card['name']}` is run by a
pipeline script I write; results must be reproducible from executed code and receipts.

## Approach
- Preprocess: read each case listed in the index, normalise intensities with the card's
  preprocessing ({card['preprocess']}), check the image bit depth.
- Inference: run `{model_dir}/{card['runner']['entry']}` with the weights via `{A['pipeline']}`,
  first on the validation cases {', '.join(spec['validation_case_ids'])}, then on all cases.
- Postprocess: check shapes against the prediction schema ({spec['prediction_schema']['type']}),
  reject degenerate outputs, convert predictions into the native submission format.

## Resources
- Model card `{spec['model']['card']}`, weights `{model_dir}/{card['weights']}` (format
  version {card['format_version']}), runner `{model_dir}/{card['runner']['entry']}`, converter
  `{model_dir}/{card['converter']}`; requires {', '.join(card['requires'])}.
- Data folder `{spec['data']['dir']}`, index `{spec['data']['index']}`: {hidden['n_cases']} cases.

## Outputs
- Setup records in `setup/`, pipeline `{A['pipeline']}` + `{A['pipeline_config']}`.
- Validation `{A['validation_output']}` + `{A['validation_receipt']}`.
- Predictions `{A['predictions']}` + `{A['predictions_receipt']}`.
- Submission `{sub['path']}` ({sub['format']}) + `{A['submission_receipt']}`, or
  `{A['failure_report']}` if the task cannot be completed honestly.

## Risks
Checkpoint hash or format version mismatch, missing modules, corrupted cases, degenerate
outputs: each is checked before the full run and reported rather than hidden.
"""


def _s1(inst: TaskInstance) -> list[Action]:
  inspect = ("cat task/spec.json; echo; find . -type f | sort; echo; cat models/*/card.json; "
             "echo; for f in data/*/*.csv; do echo \"$f: $(($(wc -l < \"$f\") - 1)) cases\"; "
             "head -n 3 \"$f\"; done")
  write = ("import os\nos.makedirs('plan', exist_ok=True)\nPLAN = '''" + _plan_text(inst) +
           "'''\nwith open('plan/plan.md.tmp', 'w') as f:\n  f.write(PLAN)\n"
           "os.replace('plan/plan.md.tmp', 'plan/plan.md')\nprint(len(PLAN), 'chars written')\n")
  return [_act("bash", inspect, "Inspect the spec, the files, the model card and the data index."),
          _act("python", write, "Write a plan grounded in this workspace's files and counts.")]


_SETUP_RECORDS = """import hashlib, importlib.util, json, os, platform
def write_json(path, obj):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
  os.replace(path + ".tmp", path)
spec = json.load(open("task/spec.json"))
card = json.load(open(spec["model"]["card"]))
model_dir = os.path.dirname(spec["model"]["card"])
modules = {m: importlib.util.find_spec(m) is not None for m in card["requires"]}
write_json("setup/environment.json", {"python": platform.python_version(), "modules": modules,
                                      "ready": all(modules.values())})
weights = os.path.join(model_dir, card["weights"])
raw = open(weights, "rb").read()
try:
  version, parse_error = json.loads(raw).get("format_version"), None
except ValueError as e:
  version, parse_error = None, str(e)
supported = card["runner"]["supports_format_versions"]
write_json("setup/compatibility.json", {"weights_format_version": version,
           "runner_supports": supported, "compatible": version in supported,
           "parse_error": parse_error})
try:
  entry = os.path.join(model_dir, card["runner"]["entry"])
  s = importlib.util.spec_from_file_location("runner", entry)
  runner = importlib.util.module_from_spec(s)
  s.loader.exec_module(runner)
  runner.load_weights(weights)
  load_ok, load_error = True, None
except Exception as e:
  load_ok, load_error = False, "%s: %s" % (type(e).__name__, e)
sha = hashlib.sha256(raw).hexdigest()
write_json("setup/checkpoint.json", {"path": weights, "sha256": sha, "card_sha256": card["sha256"],
           "sha256_matches_card": sha == card["sha256"], "load_ok": load_ok,
           "load_error": load_error})
print(json.dumps({"modules": modules, "compatible": version in supported, "load_ok": load_ok,
                  "sha256_matches_card": sha == card["sha256"], "error": load_error}))
"""

_CONFIG = """python - <<'PY'
import json, os
spec = json.load(open("task/spec.json"))
card = json.load(open(spec["model"]["card"]))
model_dir = os.path.dirname(spec["model"]["card"])
config = {"card": spec["model"]["card"], "runner": os.path.join(model_dir, card["runner"]["entry"]),
          "weights": os.path.join(model_dir, card["weights"]), "data_dir": spec["data"]["dir"],
          "index": spec["data"]["index"], "exclude": [],
          "intensity_scale": card["preprocess"]["intensity_scale"]}
with open("pipeline/config.json.tmp", "w") as f:
  json.dump(config, f, indent=1, sort_keys=True)
os.replace("pipeline/config.json.tmp", "pipeline/config.json")
print(json.dumps(config))
PY
"""


def _heredoc(path: str, text: str) -> str:
  if "\nPYEOF\n" in text:
    raise ValueError(f"heredoc terminator found in the text for {path}")
  return f"cat > {path} <<'PYEOF'\n{text}PYEOF\n"


def _s2(inst: TaskInstance) -> list[Action]:
  del inst
  src = pipeline_sources()
  return [
      _act("python", _SETUP_RECORDS, "Record the environment, the weights' format "
           "compatibility and the checkpoint (hash, load result) before writing code."),
      _act("bash", "mkdir -p pipeline\n" + _heredoc("pipeline/checks.py", src["checks.py"]) +
           "python -m py_compile pipeline/checks.py && echo checks ok\n",
           "Write shared helpers: hashing, receipts, shape and degeneracy checks, diagnosis."),
      _act("bash", _heredoc(A["pipeline"], src["infer.py"]) +
           _CONFIG + f"python -m py_compile {A['pipeline']} && echo pipeline ok\n",
           "Write the inference pipeline and its config from the model card."),
      _act("bash", _heredoc("pipeline/submission.py", src["submission.py"]) +
           "python -m py_compile pipeline/submission.py && echo submission writer ok\n",
           "Write the native-format submission writer/reader for the hand-off.")]


def _run(out: str, cases: list[str] | None, tolerate_failure: bool) -> str:
  cmd = f"python {A['pipeline']} --out {out}" + (f" --cases {','.join(cases)}" if cases else "")
  return cmd + (' || echo "pipeline exited with status $?"' if tolerate_failure else "")


_VALIDATE = _PRELUDE + """result = json.load(open("validation/small_case.json"))
preds = [r["prediction"] for r in result["records"] if "prediction" in r]
checks = {"cases": sorted(r["case_id"] for r in result["records"]), "status": result["status"],
          "shape_ok": bool(preds) and all(prediction_ok(p, schema) for p in preds),
          "non_degenerate": bool(preds) and not degenerate(preds, schema)}
files = [p for p in ("validation/small_case.json", "validation/diagnosis.json",
                     "validation/correction.json") if os.path.exists(p)]
write_receipt("validation/receipt.json", "S3", files, checks)
print(json.dumps(checks))
assert checks["shape_ok"] and checks["non_degenerate"] and result["status"] == "ok", checks
"""

_DIAGNOSE = _PRELUDE + """card = json.load(open(config["card"]))
result = json.load(open("validation/small_case.json"))
found = diagnose(result, schema, config, card)
atomic_write_json("validation/diagnosis.json", found)
print(json.dumps(found))
"""

_FIXES = {
    "corrupted_case": ("""diagnosis = json.load(open("validation/diagnosis.json"))
config["exclude"] = sorted(set(config["exclude"]) | {diagnosis["subject"]})
action = "excluded unreadable case %s from inference" % diagnosis["subject"]
changed = ["pipeline/config.json"]
""", "The case input is corrupted and cannot be read: exclude it and record why."),
    "version_mismatch": ("""import subprocess
card = json.load(open(config["card"]))
target = card["runner"]["supports_format_versions"][0]
src = config["weights"]
dst = src[:-len(".json")] + "_converted_v%d.json" % target
converter = os.path.join(os.path.dirname(config["card"]), card["converter"])
subprocess.run([sys.executable, converter, src, dst, "--to", str(target)], check=True)
config["weights"] = dst
action = "converted %s to format_version %d with %s" % (src, target, converter)
changed = ["pipeline/config.json", dst]
""", "The weights use a newer format than the runner reads: convert them with the shipped "
        "converter and point the pipeline at the converted copy."),
    "degenerate_output": ("""old = config["intensity_scale"]
config["intensity_scale"] = "maxval"
action = "intensity_scale %r saturates the data; use each image's own maxval" % (old,)
changed = ["pipeline/config.json"]
""", "Every output is the same: the fixed intensity scale saturates this data's bit depth; "
        "normalise by each image's maxval instead."),
}

_FIX_EPILOGUE = """atomic_write_json("pipeline/config.json", config)
atomic_write_json("validation/correction.json", {"fault": json.load(open(
    "validation/diagnosis.json"))["fault"], "action": action, "changed": changed})
print(action)
"""

_FAILED_RECEIPT = _PRELUDE + """diagnosis = json.load(open("validation/diagnosis.json"))
result = json.load(open("validation/small_case.json"))
write_receipt("validation/receipt.json", "S3", ["validation/small_case.json",
              "validation/diagnosis.json"], {"status": result["status"],
              "fault": diagnosis["fault"], "recoverable": diagnosis["recoverable"]})
print("validation failed: %s (%s); not recoverable here" % (diagnosis["fault"],
                                                           diagnosis["subject"]))
"""


def _s3(inst: TaskInstance) -> list[Action]:
  ids = inst.spec["validation_case_ids"]
  out = A["validation_output"]
  if inst.outcome == "success":
    return [_act("bash", _run(out, ids, False), "Run the pipeline on the small validation cases."),
            _act("python", _VALIDATE, "Check output shapes and non-degeneracy; write the "
                 "validation receipt.")]
  first = [_act("bash", _run(out, ids, True), "Run the pipeline on the small validation cases."),
           _act("python", _DIAGNOSE, "The validation run went wrong: diagnose what is at fault.")]
  if inst.outcome == "failure":
    return first + [_act("python", _FAILED_RECEIPT, "The fault cannot be fixed inside the "
                         "sandbox: record the failed validation honestly.")]
  fix, thought = _FIXES[inst.hidden["fault"]]
  return first + [
      _act("python", _PRELUDE + fix + _FIX_EPILOGUE, thought),
      _act("bash", _run(out, ids, False), "Re-run the validation cases with the correction."),
      _act("python", _VALIDATE, "Verify the corrected output and write the receipt.")]


_COVERAGE = _PRELUDE + """rows = list(csv.DictReader(open(config["index"])))
expected = sorted(r["case_id"] for r in rows if r["case_id"] not in config["exclude"])
records = [json.loads(line) for line in open("outputs/predictions.jsonl") if line.strip()]
predicted = sorted(r["case_id"] for r in records if "prediction" in r)
checks = {"expected": len(expected), "predicted": len(predicted),
          "missing": sorted(set(expected) - set(predicted)), "excluded": config["exclude"],
          "shape_ok": all(prediction_ok(r["prediction"], schema) for r in records
                          if "prediction" in r)}
write_receipt("outputs/receipt.json", "S4", ["outputs/predictions.jsonl"], checks)
print(json.dumps(checks))
assert not checks["missing"] and checks["shape_ok"], checks
"""

_BLOCKED = _PRELUDE + """diagnosis = json.load(open("validation/diagnosis.json"))
write_receipt("outputs/receipt.json", "S4", [], {"status": "blocked", "fault": diagnosis["fault"],
              "subject": diagnosis["subject"], "predictions_written": False})
print("inference blocked by %s (%s); no predictions written" % (diagnosis["fault"],
                                                              diagnosis["subject"]))
"""


def _s4(inst: TaskInstance) -> list[Action]:
  if inst.outcome == "failure":
    return [_act("python", _BLOCKED, "Inference cannot run: record the blocker instead of "
                 "producing predictions.")]
  return [_act("bash", _run(A["predictions"], None, False), "Run inference over every case."),
          _act("python", _COVERAGE, "Check coverage against the index and write the receipt.")]


_WRITE_SUBMISSION = _PRELUDE + """from submission import write_submission
records = [json.loads(line) for line in open("outputs/predictions.jsonl") if line.strip()]
written = write_submission(spec["submission"], {r["case_id"]: r["prediction"] for r in records
                                                if "prediction" in r})
print("wrote", len(written), "files under", spec["submission"]["path"])
"""

_CHECK_SUBMISSION = _PRELUDE + """from submission import read_submission
submitted = read_submission(spec["submission"])
rows = list(csv.DictReader(open(config["index"])))
expected = sorted(r["case_id"] for r in rows if r["case_id"] not in config["exclude"])
files = sorted(os.path.join(d, f).replace(os.sep, "/") for d, _, fs in os.walk("submission")
               for f in fs if f != "receipt.json")
checks = {"schema_ok": True, "cases": len(submitted),
          "missing": sorted(set(expected) - set(submitted)),
          "unexpected": sorted(set(submitted) - set(expected)), "excluded": config["exclude"]}
write_receipt("submission/receipt.json", "S5", files, checks)
print(json.dumps(checks))
assert not checks["missing"] and not checks["unexpected"], checks
"""

_FAILURE_REPORT = _PRELUDE + """diagnosis = json.load(open("validation/diagnosis.json"))
report = {"status": "failed", "fault": diagnosis["fault"], "subject": diagnosis["subject"],
          "reason": diagnosis["evidence"], "predictions_submitted": 0,
          "evidence": ["setup/checkpoint.json", "setup/environment.json",
                       "validation/diagnosis.json", "outputs/receipt.json"]}
atomic_write_json("submission/failure_report.json", report)
write_receipt("submission/receipt.json", "S5", ["submission/failure_report.json"],
              {"status": "failed", "fault": diagnosis["fault"]})
print(json.dumps(report))
"""


def _s5(inst: TaskInstance) -> list[Action]:
  if inst.outcome == "failure":
    return [_act("python", _FAILURE_REPORT, "Hand off an honest failure report, no results.")]
  return [_act("python", _WRITE_SUBMISSION, "Convert predictions into the native format."),
          _act("python", _CHECK_SUBMISSION, "Read the submission back, check completeness, "
               "write the hand-off receipt.")]


_STAGE_ACTIONS = {"S1": _s1, "S2": _s2, "S3": _s3, "S4": _s4, "S5": _s5}


def expert_actions(instance: TaskInstance, stage: str) -> list[Action]:
  """The expert's actions for one stage of `instance` (S1..S5), in the instance's action
  space (`code`: written code; `stage_tools`: short tool calls, `bat_jax.taskkit.toolspace`)."""
  if stage not in _STAGE_ACTIONS:
    raise ValueError(f"unknown stage {stage!r}; expected one of {workflow.STAGES}")
  if instance.action_space == "stage_tools":
    return toolspace.tool_actions(instance, stage)
  return _STAGE_ACTIONS[stage](instance)
