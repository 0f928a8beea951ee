"""Builds one round: plan the view, synthesise rows, leak-check them, publish the shards."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

from bat_jax import markers
from bat_jax import workflow
from bat_jax.stagebank import leakcheck
from bat_jax.stagebank import rl_rows
from bat_jax.stagebank import rounds
from bat_jax.stagebank import shards
from bat_jax.stagebank import task_source

BUILDER_VERSION = "bat_jax.stagebank/1"
MARKERS_FILE = "markers.json"  # default place of the evaluator's hashed export in a bank
MAKE_MARKERS = "python -m bat_jax.evaluator --markers-only --markers=PATH"  # how to write one
# A round the leak check rejects for at most this many rows is built again from other tasks
# (`build_and_publish`), at most `MAX_ROUND_ATTEMPTS` times in all.
MAX_CHANCE_REJECTIONS = 2
MAX_ROUND_ATTEMPTS = 4


# A task's description and the held-out markers in its initial workspace.
_Described = tuple[rl_rows.TaskDescription, list[leakcheck.LeakFinding]]


@dataclasses.dataclass(frozen=True)
class BuiltRound:
  """A round's rows (per pool, in order), its batch composition and its leak receipt."""
  spec: rounds.RoundSpec
  pools: Mapping[str, list[dict[str, Any]]]
  composition: Mapping[str, int]
  receipt: leakcheck.LeakReceipt


_worker_source: rl_rows.TaskSource | None = None
_worker_checker: leakcheck.LeakChecker | None = None
# (track, outcome, seed) -> markers in that task's initial workspace, in this process.
_workspace_memo: dict[tuple[str, str, int], list[leakcheck.LeakFinding]] = {}


def _init_worker(source: rl_rows.TaskSource, checker: leakcheck.LeakChecker | None) -> None:
  global _worker_source, _worker_checker
  _worker_source, _worker_checker = source, checker
  _workspace_memo.clear()


def _describe_and_scan(source: rl_rows.TaskSource, checker: leakcheck.LeakChecker | None,
                       key: tuple[str, str, int, str]) -> _Described:
  """source.describe(*key); with a checker and a `bat_jax.train_tasks` source, also the markers in
  the task's initial workspace (the files its digest covers), scanned once per task."""
  if checker is None or not isinstance(source, task_source.TasksPackageSource):
    return source.describe(*key), []
  task, files = source.describe_with_files(*key)
  found = _workspace_memo.get(key[:3])
  if found is None:
    found = _workspace_memo[key[:3]] = checker.check_workspace(files)
  return task, found


def _describe_in_worker(key: tuple[str, str, int, str]) -> _Described:
  return _describe_and_scan(_worker_source, _worker_checker, key)


def workspace_findings(checker: leakcheck.LeakChecker, row: Mapping[str, Any], index: int,
                       pool: str) -> list[leakcheck.LeakFinding]:
  """Markers in the workspace an RL row resets to (regenerated from its recipe, digest checked);
  rows of other task sources carry no regenerable workspace and give none."""
  recipe = row["extra_info"]["workspace_recipe"]
  if recipe["generator"] != f"{task_source.TasksPackageSource.name}/{recipe['track']}":
    return []
  instance = task_source.instance_for(row)
  return checker.check_workspace(instance.files, index=index, pool=pool)


def scan_workspaces(checker: leakcheck.LeakChecker,
                    pools: Mapping[str, Sequence[Any]]) -> list[leakcheck.LeakFinding]:
  """`workspace_findings` of every row of a round (row indices as in its leak receipt).

  Serial, in this process: the checker's memo tables are warm from the rows and stay warm
  across workspaces (a process pool re-sent the checker to each worker and started every
  memo cold: slower than this). Rows whose workspaces are identical (same recipe, same
  content digest) are scanned once.
  """
  findings: list[leakcheck.LeakFinding] = []
  by_workspace: dict[str, list[leakcheck.LeakFinding]] = {}
  index = 0
  for pool, rows in pools.items():
    for row in rows:
      recipe = row["extra_info"]["workspace_recipe"]  # what `task_source.instance_for` reads
      key = json.dumps([recipe["generator"], recipe["track"], recipe["seed"], recipe["outcome"],
                        recipe.get("action_space", "code"),
                        row["extra_info"]["provenance"]["source_digest"]])
      if key not in by_workspace:
        by_workspace[key] = workspace_findings(checker, row, 0, "")
      findings.extend(dataclasses.replace(f, row=index, pool=pool) for f in by_workspace[key])
      index += 1
  return findings


def describe_all(source: rl_rows.TaskSource, slots: Sequence[rounds.RowSlot], *,
                 workers: int = 1,
                 checker: leakcheck.LeakChecker | None = None) -> list[_Described]:
  """(task description, workspace markers) of `slots`, in order (see `_describe_and_scan`;
  finding rows and pools are set by the caller). Task generation fans out over `workers`
  processes (it dominates build time: the families synthesise images in pure Python); the
  workspace scan rides along, on files just generated, instead of regenerating them."""
  keys = [(s.track, s.outcome, s.task_seed, s.stage) for s in slots]
  if workers <= 1 or len(keys) < 2 * workers:
    _workspace_memo.clear()
    try:
      return [_describe_and_scan(source, checker, k) for k in keys]
    finally:
      _workspace_memo.clear()
  chunk = max(1, len(keys) // (8 * workers))
  with concurrent.futures.ProcessPoolExecutor(workers, initializer=_init_worker,
                                              initargs=(source, checker)) as executor:
    return list(executor.map(_describe_in_worker, keys, chunksize=chunk))


def build_round(spec: rounds.RoundSpec, source: rl_rows.TaskSource,
                checker: leakcheck.LeakChecker, *, workers: int = 1) -> BuiltRound:
  """Synthesises and leak-checks a round in memory.

  Args:
    spec: the round.
    source: where task briefs and workspace digests come from.
    checker: the leak pre-check.
    workers: processes for task generation (1: in this process).

  Raises:
    RoundRejected: any row failed the leak pre-check (fail-closed: the whole round).
  """
  view = rounds.plan_round(spec)
  round_target = spec.weights.primary_stage
  slots = [slot for pool in workflow.POOLS for slot in view[pool]]
  described = describe_all(source, slots, workers=workers, checker=checker)
  pools = {pool: [] for pool in workflow.POOLS}
  for slot, (task, _) in zip(slots, described):
    pools[slot.pool].append(rl_rows.rl_row(slot, task, round_index=spec.round_index,
                                           round_target=round_target))
  receipt = checker.check_rows((pool, row) for pool, rows in pools.items() for row in rows)
  if receipt.passed:
    # slots run pool by pool, so a slot's index is its row's index in the receipt.
    in_workspaces = [dataclasses.replace(f, row=i, pool=slots[i].pool)
                     for i, (_, found) in enumerate(described) for f in found]
    if in_workspaces:
      receipt = dataclasses.replace(
          receipt, rows_rejected=len({f.row for f in in_workspaces}),
          rejections_by_reason={**receipt.rejections_by_reason,
                                "heldout_marker": len({f.row for f in in_workspaces})},
          samples=tuple(in_workspaces[:20]))
  if not receipt.passed:
    raise leakcheck.RoundRejected(receipt)
  return BuiltRound(spec, pools, rounds.batch_composition(spec.weights.pool_mix,
                                                          spec.rows_per_batch), receipt)


def publish(bank: Path, built: BuiltRound, *, source_name: str,
            rejected_attempts: Sequence[Mapping[str, Any]] = ()) -> Path:
  """Writes a built round's shards + manifest atomically into `bank` (with the leak receipts of
  the attempts rejected before it, if any)."""
  return shards.publish_round(bank, built.spec.round_index, built.pools, {
      "config": {**built.spec.to_json(), "builder": BUILDER_VERSION, "task_source": source_name,
                 "data_source": rounds.DATA_SOURCE},
      "curriculum_weights": built.spec.weights.to_json(),
      "round_target": built.spec.weights.primary_stage,
      "batch_composition": dict(built.composition),
      "pool_order": list(workflow.POOLS),
      "leak_receipt": built.receipt.to_json(),
      **({"rejected_attempts": list(rejected_attempts)} if rejected_attempts else {}),
  })


def load_matcher(path: Path | None, *, allow_no_markers: bool = False) -> markers.MarkerMatcher:
  """The marker matcher from an evaluator export file.

  Fails closed: a missing export is an error unless `allow_no_markers` (an explicit development
  flag, `--allow-no-markers`), which gives an empty matcher and a receipt that records it.
  """
  if path is None or not Path(path).is_file():
    if not allow_no_markers:
      what = ("no held-out marker export given (--markers=PATH)" if path is None
              else f"held-out marker export {path} does not exist")
      raise FileNotFoundError(
          f"{what}: the leak pre-check fails closed. Make one with `{MAKE_MARKERS}` (the same "
          "--tier/--seed/--cells-per-track as the evaluation), or pass --allow-no-markers for "
          "a development build without held-out markers")
    logging.warning("no held-out marker export at %s: leak check runs without markers "
                    "(--allow-no-markers; the receipt records it)", path)
    return markers.MarkerMatcher(markers.empty_export())
  try:
    export = json.loads(Path(path).read_bytes())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"marker export {path} is not valid JSON: {e}") from None
  if not isinstance(export, dict):
    raise ValueError(f"marker export {path} is not a JSON object")
  try:
    return markers.MarkerMatcher(export)
  except (ValueError, TypeError, AttributeError) as e:
    raise ValueError(f"marker export {path}: {e}") from None


def build_and_publish(bank: Path, spec: rounds.RoundSpec, source: rl_rows.TaskSource, *,
                      markers_path: Path | None = None, workers: int = 1,
                      allow_no_markers: bool = False) -> Path:
  """build_round + publish. Markers: `markers_path`, else `BANK/markers.json`; one of them must
  exist unless `allow_no_markers`. A round rejected for at most `MAX_CHANCE_REJECTIONS` rows is
  built again from other tasks (`RoundSpec.attempt`); the rejected receipts go in the manifest.

  Raises:
    RoundRejected: more rows than that, or `MAX_ROUND_ATTEMPTS` rejections (nothing published).
  """
  bank = Path(bank)
  matcher = load_matcher(bank / MARKERS_FILE if markers_path is None else markers_path,
                         allow_no_markers=allow_no_markers)
  checker = leakcheck.LeakChecker(matcher, allow_no_markers=allow_no_markers)
  rejected: list[dict[str, Any]] = []
  for attempt in range(MAX_ROUND_ATTEMPTS):
    try:
      built = build_round(dataclasses.replace(spec, attempt=attempt), source, checker,
                          workers=workers)
      break
    except leakcheck.RoundRejected as e:
      # A row or two that spell a held-out marker by chance (a hex id beside the next field,
      # common words in pieces) reject the round; it is built again from other tasks. More
      # rows than that, or every attempt, is a generator that leaks: the rejection stands.
      if e.receipt.rows_rejected > MAX_CHANCE_REJECTIONS or attempt + 1 == MAX_ROUND_ATTEMPTS:
        raise
      logging.warning("round %d attempt %d rejected (%s); building it again from other tasks",
                      spec.round_index, attempt, e)
      rejected.append(e.receipt.to_json())
  return publish(bank, built, source_name=source.name, rejected_attempts=rejected)
