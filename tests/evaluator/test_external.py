"""External evaluator adapter: argv template without a shell, output validated, bad output
stops the caller."""

import copy
import json
import sys

import pytest

from bat_jax.evaluator.external import ExternalEvaluator, ExternalEvaluatorError, parse_argv

# A stand-in benchmark: copies the report from argv[4] to {output}; records its argv.
FAKE = r"""
import json, sys, shutil
checkpoint, request, output, source = sys.argv[1:5]
req = json.load(open(request))
if source == "@exit":
  sys.exit(4)
if source == "@none":
  sys.exit(0)
if source == "@echo":
  json.dump({"argv": sys.argv[1:], "request": req}, open(output, "w")); sys.exit(0)
shutil.copy(source, output)
"""


def _evaluator(tmp_path, source, timeout_s=60.0):
  script = tmp_path / "fake_bench.py"
  script.write_text(FAKE)
  return ExternalEvaluator(argv=(sys.executable, str(script), "{checkpoint}", "{request}",
                                 "{output}", str(source)), timeout_s=timeout_s)


def _write(tmp_path, obj, name="src.json"):
  path = tmp_path / name
  path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
  return path


def test_a_valid_report_is_returned(tmp_path, good_report):
  ev = _evaluator(tmp_path, _write(tmp_path, good_report))
  report = ev.evaluate(tmp_path / "ckpt", {"tier": "lite", "seed": 3}, tmp_path / "run")
  assert report == good_report
  assert json.loads((tmp_path / "run" / "request.json").read_text())["seed"] == 3


def test_placeholders_are_filled_without_a_shell(tmp_path):
  ev = _evaluator(tmp_path, "@echo")
  checkpoint = "ckpt dir; rm -rf ~ {output}"
  with pytest.raises(ExternalEvaluatorError, match=r"\$\.argv: is not an allowed field"):
    ev.evaluate(checkpoint, {}, tmp_path / "run")
  echoed = json.loads((tmp_path / "run" / "output.json").read_text())
  assert echoed["argv"][0] == checkpoint  # passed literally, never re-expanded
  assert echoed["argv"][2] == str(tmp_path / "run" / "output.json")


def _mutations(good):
  def m(fn):
    bad = copy.deepcopy(good)
    fn(bad)
    return bad
  return {
      "not_json": "{this is not json",
      "list": [good],
      "missing_field": m(lambda r: r.pop("overall")),
      "forbidden_field": m(lambda r: r.update(task_ids=["ho-1"])),
      "answer_in_track": m(lambda r: r["track_scores"]["vqa"].update(answers={"q": "left"})),
      "invalid_cells": m(lambda r: r.update(validity={"valid": False, "valid_cells": 2,
                                                      "invalid_cells": 1},
                                            failure_categories={"timeout": 1})),
      "null_overall": m(lambda r: r.update(overall=None)),
      "null_stage": m(lambda r: r["stage_scores"].update(S2=None)),
      "null_track": m(lambda r: r["track_scores"]["vqa"].update(overall=None)),
  }


@pytest.mark.parametrize("case", ["not_json", "list", "missing_field", "forbidden_field",
                                  "answer_in_track", "invalid_cells", "null_overall",
                                  "null_stage", "null_track"])
def test_malformed_output_is_refused(tmp_path, good_report, case):
  ev = _evaluator(tmp_path, _write(tmp_path, _mutations(good_report)[case]))
  with pytest.raises(ExternalEvaluatorError, match="output"):
    ev.evaluate("ckpt", {}, tmp_path / "run")


@pytest.mark.parametrize("source,message", [("@exit", "exited 4"), ("@none", "no output file")])
def test_failing_commands_are_refused(tmp_path, source, message):
  with pytest.raises(ExternalEvaluatorError, match=message):
    _evaluator(tmp_path, source).evaluate("ckpt", {}, tmp_path / "run")


def test_stale_output_is_never_reused(tmp_path, good_report):
  (tmp_path / "run").mkdir()
  _write(tmp_path / "run", good_report, "output.json")
  with pytest.raises(ExternalEvaluatorError, match="no output file"):
    _evaluator(tmp_path, "@none").evaluate("ckpt", {}, tmp_path / "run")


def test_timeout_is_refused(tmp_path):
  ev = ExternalEvaluator(argv=(sys.executable, "-c", "import time; time.sleep(30)",
                               "{checkpoint}", "{request}", "{output}"), timeout_s=0.5)
  with pytest.raises(ExternalEvaluatorError, match="timeout"):
    ev.evaluate("ckpt", {}, tmp_path / "run")


def test_argv_template_is_validated():
  assert parse_argv('["bench", "{checkpoint}", "{request}", "{output}"]')[0] == "bench"
  with pytest.raises(ValueError, match="JSON list"):
    parse_argv("bench --ckpt {checkpoint}")
  with pytest.raises(ValueError, match=r"\{output\}"):
    parse_argv(["bench", "{checkpoint}", "{request}"])
  with pytest.raises(ValueError, match="list of strings"):
    parse_argv(["bench", 3])
