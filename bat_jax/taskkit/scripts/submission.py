"""Task-native submission formats: write them from predictions and read them back (stdlib).

A task's spec names one format and its path. `read_submission` raises ValueError naming the
file and the problem, so a schema check is simply "does it read back".
"""
from __future__ import annotations

import csv
import io
import json
import os

from bat_jax.taskkit.runners.common import format_pgm, parse_pgm  # inlined
from bat_jax.taskkit.scripts.checks import atomic_write_text  # inlined

FORMATS = ("csv", "jsonl", "coco_json", "pgm_dir", "txt_dir")


def write_submission(spec, predictions, root="."):
  """Writes {case_id: prediction} in the spec's format; returns the written relpaths."""
  fmt, path = spec["format"], spec["path"]
  ids = sorted(predictions)
  if fmt == "csv":
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([spec["id_column"], spec["value_column"]])
    writer.writerows([cid, predictions[cid]] for cid in ids)
    atomic_write_text(os.path.join(root, path), buf.getvalue())
    return [path]
  if fmt == "jsonl":
    lines = [json.dumps({spec["id_key"]: cid, spec["value_key"]: predictions[cid]})
             for cid in ids]
    atomic_write_text(os.path.join(root, path), "\n".join(lines) + "\n")
    return [path]
  if fmt == "coco_json":
    annotations = []
    for cid in ids:
      for det in predictions[cid]:
        x0, y0, x1, y1 = det["box"]
        annotations.append({spec["id_key"]: cid, "bbox": [x0, y0, x1 - x0, y1 - y0],
                            "score": det["score"]})
    blob = {"images": ids, "annotations": annotations}
    atomic_write_text(os.path.join(root, path), json.dumps(blob, indent=1) + "\n")
    return [path]
  if fmt in ("pgm_dir", "txt_dir"):
    written = []
    for cid in ids:
      rel = "%s/%s%s" % (path, cid, spec["suffix"])
      text = (format_pgm(predictions[cid], spec["maxval"]) if fmt == "pgm_dir"
              else predictions[cid] + "\n")
      atomic_write_text(os.path.join(root, rel), text)
      written.append(rel)
    return written
  raise ValueError("unknown submission format %r (known: %s)" % (fmt, ", ".join(FORMATS)))


def read_submission(spec, root="."):
  """Reads a submission back into {case_id: prediction}; ValueError names what is wrong."""
  fmt, path = spec["format"], spec["path"]
  full = os.path.join(root, path)
  if not os.path.exists(full):
    raise ValueError("submission %s is missing" % path)
  if fmt == "csv":
    with open(full, encoding="utf-8", newline="") as f:
      reader = csv.DictReader(f)
      if reader.fieldnames != [spec["id_column"], spec["value_column"]]:
        raise ValueError("%s: header %r, expected %r" % (
            path, reader.fieldnames, [spec["id_column"], spec["value_column"]]))
      return {row[spec["id_column"]]: row[spec["value_column"]] for row in reader}
  if fmt == "jsonl":
    out = {}
    with open(full, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          rec = json.loads(line)
          out[rec[spec["id_key"]]] = rec[spec["value_key"]]
        except (ValueError, KeyError, TypeError) as e:
          raise ValueError("%s line %d: %r" % (path, n, e)) from None
    return out
  if fmt == "coco_json":
    try:
      with open(full, encoding="utf-8") as f:
        blob = json.load(f)
      out = {cid: [] for cid in blob["images"]}
      for ann in blob["annotations"]:
        x, y, w, h = ann["bbox"]
        out[ann[spec["id_key"]]].append({"box": [x, y, x + w, y + h], "score": ann["score"]})
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError("%s: not a valid detection file: %r" % (path, e)) from None
    return {cid: sorted(dets, key=lambda d: d["box"]) for cid, dets in out.items()}
  if fmt in ("pgm_dir", "txt_dir"):
    if not os.path.isdir(full):
      raise ValueError("submission %s is not a folder" % path)
    out = {}
    for name in sorted(os.listdir(full)):
      if not name.endswith(spec["suffix"]):
        raise ValueError("%s/%s: unexpected file (expected *%s)" % (path, name, spec["suffix"]))
      with open(os.path.join(full, name), encoding="utf-8") as f:
        text = f.read()
      cid = name[:-len(spec["suffix"])]
      out[cid] = (parse_pgm(text, "%s/%s" % (path, name))[3] if fmt == "pgm_dir"
                  else text.rstrip("\n"))
    return out
  raise ValueError("unknown submission format %r (known: %s)" % (fmt, ", ".join(FORMATS)))
