"""External evaluator adapter: run a real benchmark (e.g. AutoMedBench) as a command.

The command is an argv template -- a JSON list of strings, never a shell line -- holding the
placeholders `{checkpoint}` (the exported HF checkpoint folder), `{request}` (a JSON file this
adapter writes: what to evaluate) and `{output}` (where the command must write its aggregate
report). The output must be a report the firewall admits (`firewall.REPORT_RULE`, tier
`external` allowed) with every cell valid and no null score; anything else stops the caller with
an `ExternalEvaluatorError` that says what was wrong.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

from bat_jax.evaluator import aggregation
from bat_jax.evaluator.firewall import FirewallError
from bat_jax.io_utils import atomic_write_json

PLACEHOLDERS: tuple[str, ...] = ("{checkpoint}", "{request}", "{output}")
REQUEST_SCHEMA = "bat_jax.evaluator.request/v1"
_PLACEHOLDER_RE = re.compile(r"\{(checkpoint|request|output)\}")


class ExternalEvaluatorError(RuntimeError):
  """The external evaluator failed or its output cannot be used."""


def parse_argv(template: str | Sequence[str]) -> tuple[str, ...]:
  """An argv template from a JSON list (string) or a sequence of strings; validated."""
  if isinstance(template, str):
    try:
      template = json.loads(template)
    except ValueError as e:
      raise ValueError(f"external evaluator argv must be a JSON list of strings: {e}") from None
  if isinstance(template, str) or not isinstance(template, Sequence) or not template \
      or not all(isinstance(a, str) for a in template):
    raise ValueError(f"external evaluator argv must be a non-empty list of strings, got "
                     f"{template!r:.200}")
  joined = "\n".join(template)
  missing = [p for p in PLACEHOLDERS if p not in joined]
  if missing:
    raise ValueError(f"external evaluator argv lacks the placeholder(s) {missing}")
  return tuple(template)


@dataclasses.dataclass(frozen=True)
class ExternalEvaluator:
  """Runs `argv` (placeholders filled, no shell) and validates the report it writes."""
  argv: tuple[str, ...]
  timeout_s: float = 7200.0

  def __post_init__(self):
    object.__setattr__(self, "argv", parse_argv(self.argv))
    if not self.timeout_s > 0:
      raise ValueError(f"external evaluator timeout_s must be > 0, got {self.timeout_s!r}")

  def command(self, checkpoint: str, request: Path, output: Path) -> list[str]:
    """argv with every placeholder filled in one pass (a value is never re-expanded)."""
    values = {"checkpoint": str(checkpoint), "request": str(request), "output": str(output)}
    return [_PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], a) for a in self.argv]

  def evaluate(self, checkpoint: str | Path, request: Mapping[str, Any],
               work_dir: Path) -> dict[str, Any]:
    """Runs the evaluator on `checkpoint`; returns its validated aggregate report.

    Raises:
      ExternalEvaluatorError: the command failed, timed out or wrote no / malformed output, the
        report holds a field the firewall rejects, or it has invalid cells or null scores.
    """
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    request_path, output_path = work_dir / "request.json", work_dir / "output.json"
    output_path.unlink(missing_ok=True)  # never read a previous run's report
    atomic_write_json(str(request_path), {"schema": REQUEST_SCHEMA, **request})
    argv = self.command(str(checkpoint), request_path, output_path)
    try:
      done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s,
                            check=False)
    except subprocess.TimeoutExpired:
      raise ExternalEvaluatorError(f"external evaluator {argv[0]!r} ran past its "
                                   f"{self.timeout_s:g} s timeout") from None
    except OSError as e:
      raise ExternalEvaluatorError(f"external evaluator {argv[0]!r} could not start: {e}") \
          from None
    if done.returncode != 0:
      raise ExternalEvaluatorError(f"external evaluator {argv[0]!r} exited {done.returncode}: "
                                   f"{done.stderr.strip()[-2000:]!r}")
    return read_output(output_path)


def read_output(path: Path) -> dict[str, Any]:
  """Loads and validates an external evaluator's output file."""
  if not Path(path).is_file():
    raise ExternalEvaluatorError(f"external evaluator wrote no output file {str(path)!r}")
  try:
    report = json.loads(Path(path).read_text(encoding="utf-8"))
  except (ValueError, UnicodeDecodeError) as e:
    raise ExternalEvaluatorError(f"external evaluator output {str(path)!r} is not JSON: {e}") \
        from None
  try:
    aggregation.require_complete(report, source=f"external evaluator output {str(path)!r}")
  except FirewallError as e:
    raise ExternalEvaluatorError(f"external evaluator output {str(path)!r} rejected: {e}") \
        from None
  except ValueError as e:
    raise ExternalEvaluatorError(str(e)) from None
  return report
