"""Generic output checks, receipts and fault diagnosis (stdlib only).

The expert solver pastes this file into its S3-S5 actions; the rubric imports it to re-check what
a receipt claims, so both sides agree on what "shape ok" and "degenerate" mean.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

# A prediction set is degenerate when every prediction is identical, or when an image
# prediction is (almost) one flat value.
FLAT_IMAGE_FRACTION = 0.995


def sha256_file(path):
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 16), b""):
      h.update(block)
  return h.hexdigest()


def atomic_write_text(path, text):
  """Writes text to path via tmp + fsync + rename, creating parent folders."""
  if os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def atomic_write_json(path, obj):
  atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def write_receipt(path, stage, files, checks):
  """A receipt naming `files` (relpaths) by their current sha256."""
  atomic_write_json(path, {"stage": stage, "files": {f: sha256_file(f) for f in sorted(files)},
                           "checks": checks})


def _is_grid(value, width, height):
  return (isinstance(value, list) and len(value) == height
          and all(isinstance(r, list) and len(r) == width for r in value))


def prediction_ok(pred, schema):
  """Whether one prediction has the shape / type the task's prediction schema demands."""
  kind = schema["type"]
  if kind == "label":
    return pred in schema["labels"]
  if kind == "answer":
    return isinstance(pred, str) and 0 < len(pred) <= 64
  if kind == "text":
    return isinstance(pred, str) and len(pred) >= schema["min_chars"]
  if kind == "boxes":
    return isinstance(pred, list) and all(
        isinstance(b, dict) and isinstance(b.get("box"), list) and len(b["box"]) == 4
        and 0 <= b["box"][0] < b["box"][2] <= schema["width"]
        and 0 <= b["box"][1] < b["box"][3] <= schema["height"] for b in pred)
  if kind == "image":
    return _is_grid(pred, schema["width"], schema["height"]) and all(
        isinstance(v, int) and 0 <= v <= schema["maxval"] for r in pred for v in r)
  raise ValueError("unknown prediction schema type %r" % kind)


def degenerate(preds, schema):
  """True for an uninformative prediction set (all identical, or flat images)."""
  if len(preds) > 1 and len({json.dumps(p, sort_keys=True) for p in preds}) == 1:
    return True
  if schema["type"] == "image":
    for pred in preds:
      flat = [v for r in pred for v in r]
      if max(flat.count(v) for v in set(flat)) >= FLAT_IMAGE_FRACTION * len(flat):
        return True
  return False


def diagnose(result, schema, config, card):
  """Names the fault behind a validation result, or {"fault": None} when there is none.

  Args:
    result: the validation output written by pipeline/infer.py ({status, error?, records}).
    schema: the task's prediction schema.
    config: pipeline/config.json.
    card: the model card.
  """
  if result.get("status") == "failed":
    error = result.get("error", "")
    missing = re.search(r"No module named '([^']+)'", error)
    if missing:
      return {"fault": "missing_dependency", "subject": missing.group(1), "recoverable": False,
              "evidence": error}
    if "format_version" in error:
      return {"fault": "version_mismatch", "subject": config["weights"], "recoverable": True,
              "evidence": error}
    actual = sha256_file(config["weights"])
    return {"fault": "corrupted_checkpoint", "subject": config["weights"], "recoverable": False,
            "evidence": "%s; sha256 %s, card declares %s" % (error, actual, card.get("sha256"))}
  broken = [r for r in result["records"] if "error" in r]
  if broken:
    return {"fault": "corrupted_case", "subject": broken[0]["case_id"], "recoverable": True,
            "evidence": broken[0]["error"]}
  preds = [r["prediction"] for r in result["records"]]
  if degenerate(preds, schema):
    return {"fault": "degenerate_output", "subject": "intensity_scale", "recoverable": True,
            "evidence": "degenerate predictions with intensity_scale=%r"
                        % config["intensity_scale"]}
  return {"fault": None}
