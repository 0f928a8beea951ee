"""Held-out outcomes and seeds are keyed by a per-run secret the sandbox never sees.

Class "outcomes not derivable from what the sandbox sees": with a task id and every public
constant (evaluator seed, cells per track, tier, tracks, the generators' salt and vocabulary),
an attacker does no better than chance; baseline and candidate of one run (and a resumed run)
still get identical cells.
"""

import collections
import hashlib
import os
import stat

import pytest

from bat_jax import workflow
from bat_jax.evaluator import EvalSettings, RunOptions, evaluate, generators
from bat_jax.evaluator.agents import Turn, actions_taken
from bat_jax.evaluator.cells import load_or_create_secret, make_cells
from bat_jax.taskkit.base import opaque_task_id

TRACKS = ("vqa", "report", "classification")
PUBLIC = EvalSettings(tracks=TRACKS)  # the defaults and the config's evaluator seed are public


def _candidate_seeds(seed: int, cells_per_track: int, track: str) -> set[int]:
  """Every seed an attacker can derive without the secret: the pre-secret derivation, guessed
  secrets (zero, the evaluator seed spelled out), and small seeds."""
  found = set(range(500))
  for i in range(cells_per_track):
    found.add(int.from_bytes(hashlib.sha256(f"{seed}|{track}|{i}".encode()).digest()[:4], "big"))
  for guess in ("0" * 64, f"{seed:064x}", hashlib.sha256(str(seed).encode()).hexdigest()):
    found |= {c.seed for c in make_cells(seed, cells_per_track, "lite", (track,), secret=guess)}
  return found


def _attack(task_id: str, track: str, settings: EvalSettings) -> str:
  """The outcome an attacker in the sandbox would bet on, given the task id and public constants."""
  for s in _candidate_seeds(settings.seed, settings.cells_per_track, track):
    for outcome in workflow.OUTCOMES:
      if opaque_task_id(generators.HELDOUT_NAMES.salt, "heldout", track, outcome, s) == task_id:
        return outcome
  return workflow.OUTCOMES[0]  # nothing matched: a blind guess


def _accuracy(settings: EvalSettings) -> float:
  cells = settings.cells()
  ids = {c: generators.generate(c.track, c.seed, c.outcome, c.tier).task_id for c in cells}
  return sum(_attack(ids[c], c.track, PUBLIC) == c.outcome for c in cells) / len(cells)


def test_outcome_and_seed_are_not_recoverable_from_the_task_id():
  settings = EvalSettings(tracks=TRACKS)  # the run's own secret, drawn at start
  # Outcomes are balanced per track, so a blind guess is right exactly 1/3 of the time.
  assert collections.Counter(c.outcome for c in settings.cells())["success"] == \
      len(settings.cells()) // 3
  assert _accuracy(settings) == pytest.approx(1 / 3)
  for c in settings.cells():
    assert c.seed not in _candidate_seeds(PUBLIC.seed, 3, c.track)
  assert max(c.seed for c in settings.cells()) >= 1 << 40  # 64-bit: past a 2^32 brute force
  # The attacker is not vacuous: the public derivation (or a guessed secret) is fully exposed.
  exposed = EvalSettings(tracks=TRACKS, secret="0" * 64)
  assert _accuracy(exposed) == 1.0


def test_cells_are_paired_within_a_run_and_differ_across_runs():
  run = EvalSettings(cells_per_track=2)
  assert run.cells() == run.cells()  # baseline and candidate of one run: the same cells
  other = EvalSettings(cells_per_track=2)
  assert {c.seed for c in run.cells()}.isdisjoint({c.seed for c in other.cells()})
  assert run.secret not in repr(run)


def test_the_secret_is_stored_for_resume_and_bad_files_are_named(tmp_path):
  path = tmp_path / "run" / "eval_secret"
  first = load_or_create_secret(path)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
  assert load_or_create_secret(path) == first  # a resumed run: the same cells
  again = EvalSettings(secret=load_or_create_secret(path))
  assert EvalSettings(secret=first).cells() == again.cells()
  path.write_text("not-a-secret\n")
  with pytest.raises(ValueError, match=f"run secret file {path}"):
    load_or_create_secret(path)
  with pytest.raises(ValueError, match="make_cells: secret"):
    make_cells(1, 1, "lite", secret="xyz")


class _Prober:
  """Runs one probe of everything a sandboxed call can see, and keeps the observations."""
  PROBE = ("env; for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done; "
           "cat /proc/self/mountinfo /proc/self/environ; ls -laR / 2>/dev/null | head -c 100000")

  def __init__(self, seen: list):
    self.seen = seen

  def __call__(self, messages):
    self.seen.extend(m["content"] for m in messages if m.get("role") == "tool")
    if actions_taken(messages) >= 1:
      return Turn(())
    return Turn(({"name": workflow.TOOL_NAME,
                  "arguments": {"language": "bash", "code": self.PROBE}},))


def test_the_secret_never_reaches_a_sandbox(require_bwrap, tmp_path):
  seen: list[str] = []
  settings = EvalSettings(tracks=("vqa",), cells_per_track=1)
  records = tmp_path / "records"
  evaluate(lambda instance: _Prober(seen), records, settings=settings,
           options=RunOptions(workers=0, keep_workspaces=True))
  (cell,) = settings.cells()
  assert seen and "PATH=" in seen[0] and "/workspace" in seen[0]  # the probe ran and saw
  visible = "\n".join(seen)
  workspaces = [p for p in (records / "work").rglob("*") if p.is_file() and not p.is_symlink()]
  assert workspaces
  for needle in (settings.secret, str(cell.seed)):
    assert needle not in visible
    assert not [p for p in workspaces if needle.encode() in p.read_bytes()]
  assert settings.secret not in "\n".join(f"{k}={v}" for k, v in os.environ.items())


def test_the_cli_keeps_its_secret_host_side_and_pairs_through_it(tmp_path):
  import json
  from bat_jax.evaluator import __main__ as cli
  common = ["--agent=null", "--tracks=vqa", "--cells-per-track=1", "--workers=0"]
  digest = lambda out: json.loads((out / "report.json").read_text())["cell_set_digest"]
  shared = tmp_path / "secret"
  for name in ("baseline", "candidate"):
    assert cli.main([*common, f"--out={tmp_path / name}", f"--secret-file={shared}"]) == 0
  assert digest(tmp_path / "baseline") == digest(tmp_path / "candidate")  # paired for the gate
  assert cli.main([*common, f"--out={tmp_path / 'alone'}"]) == 0  # its own secret, in records
  assert (tmp_path / "alone.records" / "run_secret").is_file()
  assert digest(tmp_path / "alone") != digest(tmp_path / "baseline")
  assert shared.read_text().strip() not in (tmp_path / "baseline" / "report.json").read_text()
  with pytest.raises(SystemExit, match="--secret-file .* inside the export folder"):
    cli.main([*common, f"--out={tmp_path / 'x'}", f"--secret-file={tmp_path / 'x' / 's'}"])
