"""The S2 pipeline check: the agent's pipeline, run in the sandbox on hidden probe cases.

A pipeline that merely compiles (or writes canned outputs) earns nothing. The probe is a private
copy of the agent's `pipeline/` folder (minus its config), the task spec and card, and a clean
model (the task's runner without any planted fault, intact weights) with probe cases no workspace
holds (`hidden["probe"]`: mirrors of the validation cases). The rubric writes a
`pipeline/config.json` of the public contract pointing at them, runs
`python pipeline/infer.py --out probe/out.json --cases IDS` in the bubblewrap sandbox and
compares the records with the model's outputs (`content.same`). Results are cached per
(task, digest of the pipeline files): the G continuations of a GRPO group often share them.
"""

from __future__ import annotations

import collections
import csv
import hashlib
import io
import json
import tempfile
import threading
from pathlib import Path
from typing import Mapping

from bat_jax import workflow
from bat_jax.rubric import content
from bat_jax.rubric.workspace import Workspace
from bat_jax.sandbox import Sandbox, SandboxLimits, SandboxUnavailableError, materialize, safe_fs
from bat_jax.taskkit.base import TaskInstance

A = workflow.ARTIFACTS
PROBE_OUT = "probe/out.json"
PROBE_LIMITS = SandboxLimits(wall_s=60.0)
_CACHE_SIZE = 512
_cache: "collections.OrderedDict[tuple[str, str], tuple[bool, str]]" = collections.OrderedDict()
_cache_lock = threading.Lock()


def _index_csv(columns: list[str], rows: list[Mapping[str, str]]) -> bytes:
  buf = io.StringIO()
  writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
  writer.writeheader()
  writer.writerows(rows)
  return buf.getvalue().encode()


def _layout(inst: TaskInstance, pipeline: Mapping[str, bytes]) -> dict[str, bytes]:
  probe, card = inst.hidden["probe"], inst.spec["model"]["card"]
  files = dict(pipeline)
  files[A["spec"]] = inst.files[A["spec"]]
  files[card] = inst.files[card]
  files["probe/model/runner.py"] = probe["runner"].encode()
  files["probe/model/weights.json"] = probe["weights"].encode()
  files.update({f"probe/data/{k}": v.encode("ascii") for k, v in probe["files"].items()})
  files["probe/data/index.csv"] = _index_csv(probe["columns"], probe["rows"])
  config = {"card": card, "runner": "probe/model/runner.py", "weights": "probe/model/weights.json",
            "data_dir": "probe/data", "index": "probe/data/index.csv", "exclude": [],
            "intensity_scale": "maxval"}
  files[A["pipeline_config"]] = json.dumps(config, indent=1, sort_keys=True).encode()
  return files


def _run(inst: TaskInstance, pipeline: Mapping[str, bytes]) -> tuple[bool, str]:
  """(ok, reason): runs the probe in a fresh sandbox over a private copy."""
  probe = inst.hidden["probe"]
  ids = ",".join(r["case_id"] for r in probe["rows"])
  with tempfile.TemporaryDirectory(prefix="bat-rubric-probe-") as tmp:
    root = Path(tmp) / "ws"
    root.mkdir()
    materialize(_layout(inst, pipeline), root)
    sandbox = Sandbox(root, PROBE_LIMITS)
    try:
      res = sandbox.execute("bash", f"python {A['pipeline']} --out {PROBE_OUT} --cases {ids}")
    finally:
      sandbox.close()
    try:
      out = safe_fs.read_json(root, PROBE_OUT)
    except (OSError, ValueError) as e:
      return False, (f"{A['pipeline']} on hidden probe cases (exit {res.exit_code}) left no "
                     f"readable {PROBE_OUT}: {e}")
  got = content.predictions_of(out.get("records") if isinstance(out, dict) else None)
  bad = content.mismatched(got, probe["expected"])
  if bad:
    return False, (f"{A['pipeline']} on hidden probe cases: {len(bad)} of "
                   f"{len(probe['expected'])} predictions differ from the model's outputs")
  return True, ""


def pipeline_runs(inst: TaskInstance, ws: Workspace) -> bool:
  """Whether the produced pipeline/infer.py reproduces the model on the hidden probe cases."""
  if ws.text(A["pipeline"]) is None:
    ws.note(f"{A['pipeline']}: missing or not produced by an executed call")
    return False
  folder = A["pipeline"].rsplit("/", 1)[0]
  pipeline = {rel: ws.data(rel) for rel in ws.files_under(folder)
              if rel != A["pipeline_config"] and "/__pycache__/" not in rel}
  pipeline = {rel: data for rel, data in pipeline.items() if data is not None}
  digest = hashlib.sha256(json.dumps(sorted(
      (rel, hashlib.sha256(data).hexdigest()) for rel, data in pipeline.items())).encode())
  key = (inst.task_id, digest.hexdigest())
  with _cache_lock:
    found = _cache.get(key)
  if found is None:
    try:
      found = _run(inst, pipeline)
    except SandboxUnavailableError as e:  # fail closed; not cached (it may come back)
      ws.note(f"{A['pipeline']}: the sandbox to probe it is unavailable ({e})")
      return False
    with _cache_lock:
      _cache[key] = found
      while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
  if not found[0]:
    ws.note(found[1])
  return found[0]
