"""Helpers of the red-team tests: a policy's writes, executed in the real sandbox (so evidence
receipts exist and only the content checks stand between a made-up artifact and the reward)."""

import json
import threading

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


def score_bounded(inst, sandbox, seconds=60.0):
  """E2E score of the sandbox's workspace; fails the test if scoring blocks for `seconds`."""
  out = {}
  t = threading.Thread(target=lambda: out.update(r=rubric.score(
      inst, workflow.E2E, sandbox.workspace, sandbox.evidence)), daemon=True)
  t.start()
  t.join(seconds)
  assert not t.is_alive(), f"scoring blocked for more than {seconds} s"
  return out["r"]


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


# -- hostile artifacts (issue 24 item 2): one entry per class -------------------------------------
# Each file is a python expression the sandboxed call evaluates (tool calls are capped at 32 KB).

_WRITE_EXPR = _WRITE.replace("FILES = json.loads(%r)",
                             "FILES = {k: eval(v) for k, v in json.loads(%r).items()}")
DEEP = "'[' * 100_000 + ']' * 100_000"
DEEP_OBJECT = "'{\"a\": ' * 50_000 + '1' + '}' * 50_000"
# A pipeline the host compiler chokes on (RecursionError / MemoryError / null bytes).
CHOKING_PIPELINES = {"nested_parens": "'x = ' + '(' * 200_000 + '1' + ')' * 200_000 + '\\n'",
                     "unary_chain": "'x = ' + '-' * 400_000 + '1\\n'",
                     "null_bytes": "'import sys' + chr(0) + '\\nprint(1)\\n'"}


def _wrong_types(ids):
  c = [ids[i % len(ids)] for i in range(4)]
  lines = ['{"case_id": ["a"], "prediction": 1}',
           '{"case_id": "%s", "prediction": {"box": [[1], 2, NaN, 1e999]}}' % c[0],
           '{"case_id": "%s", "prediction": [[null, NaN], [' % c[1] + "9" * 5000 + ', {}]]}',
           '{"case_id": "%s", "prediction": null}' % c[2],
           '{"case_id": "%s", "prediction": [{"box": [0, 0, 1, 1], "score": ' % c[3]
           + "7" * 4000 + '}]}']
  return repr("\n".join(lines) + "\n")


def hostile_files(inst, kind):
  """{rel: python expression of its text} of one hostile class, for every artifact it hits."""
  sub = inst.spec["submission"]
  if kind == "deep_json":
    return {A["environment"]: DEEP_OBJECT, A["compatibility"]: DEEP, A["checkpoint"]: DEEP,
            A["pipeline_config"]: DEEP_OBJECT, A["validation_output"]: DEEP,
            A["diagnosis"]: DEEP_OBJECT, A["predictions"]: DEEP + " + '\\n'",
            **({sub["path"]: DEEP} if sub["format"] in ("coco_json", "jsonl") else {})}
  if kind in CHOKING_PIPELINES:
    return {A["pipeline"]: CHOKING_PIPELINES[kind]}
  if kind == "csv_field" and sub["format"] == "csv":
    head = f"{sub['id_column']},{sub['value_column']}\n{inst.hidden['case_ids'][0]},"
    return {sub["path"]: f"{head!r} + 'x' * 300_000 + '\\n'"}
  if kind == "wrong_types":
    val = inst.spec["validation_case_ids"][0]
    small = ('{"status": "ok", "records": [{"case_id": {"a": 1}, "prediction": NaN}, '
             '{"case_id": "%s", "prediction": [' % val + "9" * 5000 + "]}]}")
    out = {A["validation_output"]: repr(small), A["predictions"]: _wrong_types(
        inst.hidden["case_ids"])}
    if sub["format"] == "coco_json":
      coco = ('{"images": ["%s"], "annotations": [{"%s": "%s", "bbox": [[1], NaN, 1e999, 2], '
              '"score": {}}]}' % (val, sub["id_key"], val))
      out[sub["path"]] = repr(coco)
    return out
  return {}


HOSTILE_KINDS = ("deep_json", *CHOKING_PIPELINES, "csv_field", "wrong_types")


def hostile_receipts(inst, files):
  """Receipts (true digests) vouching for the hostile files of each stage."""
  out = {}
  for stage, receipt in (("S3", A["validation_receipt"]), ("S4", A["predictions_receipt"]),
                         ("S5", A["submission_receipt"])):
    named = sorted(f for f in files if f.split("/", 1)[0] in workflow.STAGE_DIRS[stage])
    if named:
      out[receipt] = (stage, named, {"shape_ok": True, "non_degenerate": True, "missing": [],
                                     "predicted": len(inst.hidden["case_ids"]),
                                     "schema_ok": True})
  return out


def hostile_action(inst, kind):
  """One execute_code action writing the hostile files of `kind` (and receipts for them)."""
  files = hostile_files(inst, kind)
  code = _WRITE_EXPR % (json.dumps(files), json.dumps(hostile_receipts(inst, files)))
  assert len(code) < 32_768, (kind, len(code))
  return {"name": workflow.TOOL_NAME, "arguments": {"language": "python", "code": code}}


class HostileAgent:
  """The expert's S1-S2, then every hostile class written by executed calls, then stop.
  Tracks other than classification / detection get the plain expert (a healthy neighbour)."""

  def __init__(self, instance):
    from bat_jax.evaluator.agents import oracle_actions
    from bat_jax.taskkit import expert_actions
    self.actions = oracle_actions(instance)
    if instance.track in ("classification", "detection"):
      self.actions = expert_actions(instance, "S1") + expert_actions(instance, "S2") + [
          hostile_action(instance, kind) for kind in HOSTILE_KINDS
          if hostile_files(instance, kind)]

  def __call__(self, messages):
    from bat_jax.evaluator.agents import ScriptedAgent
    return ScriptedAgent(self.actions)(messages)
