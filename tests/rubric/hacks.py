"""Helpers of the red-team tests: a policy's writes, executed in the real sandbox (so evidence
receipts exist and only the content checks stand between a made-up artifact and the reward)."""

import json

from bat_jax import rubric, workflow
from bat_jax.sandbox import SandboxLimits

A = workflow.ARTIFACTS
LIMITS = SandboxLimits(wall_s=60.0)

_WRITE = """import hashlib, json, os
def write(path, text):
  if os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
def receipt(path, stage, files, checks):
  digests = {f: hashlib.sha256(open(f, 'rb').read()).hexdigest() for f in files}
  write(path, json.dumps({'stage': stage, 'files': digests, 'checks': checks}))
FILES = json.loads(%r)
for path, text in FILES.items():
  write(path, text)
for path, (stage, files, checks) in json.loads(%r).items():
  receipt(path, stage, files, checks)
"""


def write_files(sandbox, files, receipts=()):
  """One executed call writing `files` {rel: text}, then receipts {rel: (stage, [files],
  checks)} over the files as written (true digests)."""
  code = _WRITE % (json.dumps(dict(files)), json.dumps(dict(receipts)))
  res = sandbox.execute("python", code)
  assert res.exit_code == 0, res.observation
  return res


def score(inst, focus, sandbox):
  return rubric.score(inst, focus, sandbox.workspace, sandbox.evidence)


def jsonl(records):
  return "".join(json.dumps(r) + "\n" for r in records)


def wrong_labels(inst, ids):
  """A plausible made-up label per case: a real label of the task, never the model's."""
  labels = inst.spec["prediction_schema"]["labels"]
  return {c: labels[(labels.index(inst.hidden["expected"][c]) + 1) % len(labels)] for c in ids}


def csv_submission(inst, preds):
  sub = inst.spec["submission"]
  lines = [f"{sub['id_column']},{sub['value_column']}"] + [f"{c},{v}" for c, v in
                                                             sorted(preds.items())]
  return {sub["path"]: "\n".join(lines) + "\n"}


S5_RECEIPT_CHECKS = {"schema_ok": True, "missing": [], "unexpected": []}
