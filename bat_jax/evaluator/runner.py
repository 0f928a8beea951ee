"""Runs cells in parallel worker processes and writes the evaluator-side records.

Each worker is a spawned process (its own session, so killing it also kills its sandboxes) that
runs cells one at a time. The parent hands out cells, enforces each cell's wall-clock budget and
replaces a worker that died or overran: that cell is recorded as invalid (`crash` /
`timeout`), the others go on. `workers=0` runs cells in this process (debugging; no timeout).

Layout of `records_dir` (evaluator side only; never exported):
  cells/<cell key>.json   one record per cell (`episode.run_cell`)
  work/<opaque id>/       the cell's workspace while it runs (removed afterwards); the id is a
                          keyed hash of the cell, so the folder names neither outcome nor seed
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import hashlib
import pickle
import secrets
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from bat_jax.evaluator import episode
from bat_jax.evaluator.agents import AgentFactory
from bat_jax.evaluator.cells import Cell
from bat_jax.sandbox import SandboxLimits
from bat_jax.io_utils import atomic_write_json
from bat_jax.rollout_protocol import RolloutLimits

Progress = Callable[[int, int, dict[str, Any]], None]  # (done, total, record)


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """How cells run (not what they measure: that is in the protocol digest)."""
  workers: int = 1
  cell_timeout_s: float = 900.0
  keep_workspaces: bool = False
  # Run cells on `workers` threads of this process instead of worker processes: for an agent
  # backed by an in-process engine that batches concurrent requests (no per-cell timeout).
  threads: bool = False

  def __post_init__(self):
    if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
      raise ValueError(f"RunOptions.workers must be an int >= 0, got {self.workers!r}")
    if not self.cell_timeout_s > 0:
      raise ValueError(f"RunOptions.cell_timeout_s must be > 0, got {self.cell_timeout_s!r}")


@dataclasses.dataclass(frozen=True)
class _Job:
  factory: AgentFactory
  records_dir: str
  limits: RolloutLimits
  sandbox_limits: SandboxLimits
  keep_workspaces: bool
  work_key: str  # per run, random: keys the opaque work-folder names

  def work_dir(self, cell: Cell) -> Path:
    name = hashlib.sha256(f"{self.work_key}|{cell.key}".encode()).hexdigest()[:16]
    return Path(self.records_dir) / "work" / name

  def run(self, cell: Cell) -> dict[str, Any]:
    """The cell's record; a harness error in one cell (which `run_cell` does not expect) is
    that cell's `crash` record, so it never loses the other cells of a threaded run."""
    start = time.monotonic()
    work = self.work_dir(cell)
    try:
      episode.remove_quietly(work)  # a crashed earlier attempt
      return episode.run_cell(cell, self.factory, work, limits=self.limits,
                              sandbox_limits=self.sandbox_limits,
                              keep_workspace=self.keep_workspaces)
    except Exception as e:  # pylint: disable=broad-except
      episode.remove_quietly(work)
      return episode.invalid_record(cell, "crash", f"cell harness raised {type(e).__name__}: "
                                    f"{e}\n{traceback.format_exc()}", time.monotonic() - start)


def _worker_main(conn: multiprocessing.connection.Connection, job: _Job) -> None:
  os.setsid()  # own group for the kill; sandboxes die with us (bwrap --die-with-parent)
  while True:
    cell = conn.recv()
    if cell is None:
      return
    conn.send(job.run(cell))


@dataclasses.dataclass
class _Worker:
  process: Any
  conn: multiprocessing.connection.Connection
  cell: Optional[Cell] = None
  started: float = 0.0

  def kill(self) -> None:
    try:
      os.killpg(self.process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      self.process.kill()
    self.process.join(5)
    self.conn.close()


def _spawn(job: _Job) -> _Worker:
  ctx = multiprocessing.get_context("spawn")
  parent, child = ctx.Pipe()
  proc = ctx.Process(target=_worker_main, args=(child, job), daemon=True,
                     name="bat-jax-eval-worker")
  proc.start()
  child.close()
  return _Worker(proc, parent)


def _parallel(cells: Sequence[Cell], job: _Job, options: RunOptions,
              finish: Callable[[dict[str, Any]], None]) -> None:
  pending = collections.deque(cells)
  workers = [_spawn(job) for _ in range(min(options.workers, len(cells)))]
  try:
    while pending or any(w.cell is not None for w in workers):
      for w in workers:
        if w.cell is None and pending:
          w.cell, w.started = pending.popleft(), time.monotonic()
          w.conn.send(w.cell)
      busy = [w for w in workers if w.cell is not None]
      now = time.monotonic()
      wait_s = max(0.0, min(w.started + options.cell_timeout_s for w in busy) - now)
      ready = multiprocessing.connection.wait(
          [w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=wait_s)
      for i, w in enumerate(workers):
        if w.cell is None:
          continue
        elapsed = time.monotonic() - w.started
        record, healthy = None, False
        if w.conn in ready or w.process.sentinel in ready:
          try:
            record = w.conn.recv() if w.conn.poll() else None
            healthy = record is not None
          except (EOFError, OSError):
            record = None
          if record is None:
            w.process.join(1)
            record = episode.invalid_record(
                w.cell, "crash", f"worker process died (exit code {w.process.exitcode})",
                elapsed)
        elif elapsed >= options.cell_timeout_s:
          record = episode.invalid_record(
              w.cell, "timeout", f"cell ran past its {options.cell_timeout_s:g} s budget", elapsed)
        if record is None:
          continue
        if healthy:
          w.cell = None
        else:  # dead or overrunning: kill it (and its sandboxes), start a fresh one if needed
          w.kill()
          episode.remove_quietly(job.work_dir(w.cell))
          workers[i] = _spawn(job) if pending else None
        finish(record)
      workers = [w for w in workers if w is not None]
  finally:
    for w in workers:
      if w.process.is_alive():
        try:
          w.conn.send(None)
        except OSError:
          pass
        w.process.join(2)
      if w.process.is_alive():
        w.kill()


def run_cells(cells: Sequence[Cell], factory: AgentFactory, records_dir: Path, *,
              limits: RolloutLimits = RolloutLimits(),
              sandbox_limits: SandboxLimits = SandboxLimits(),
              options: RunOptions = RunOptions(),
              progress: Optional[Progress] = None) -> list[dict[str, Any]]:
  """Runs every cell; returns their records in the order of `cells`."""
  if len({c.key for c in cells}) != len(cells):
    raise ValueError("run_cells: duplicate cells")
  records_dir = Path(records_dir)
  (records_dir / "cells").mkdir(parents=True, exist_ok=True)
  episode.remove_quietly(records_dir / "work")  # workspaces left by a killed earlier run
  job = _Job(factory, str(records_dir), limits, sandbox_limits, options.keep_workspaces,
             secrets.token_hex(16))
  done: dict[str, dict[str, Any]] = {}

  def finish(record: dict[str, Any]) -> None:
    key = Cell(**record["cell"]).key
    atomic_write_json(str(records_dir / "cells" / f"{key}.json"), record)
    done[key] = record
    if progress is not None:
      progress(len(done), len(cells), record)

  if options.workers > 0 and not options.threads:  # threads share the factory, no pickling
    try:
      pickle.dumps(factory)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
      raise TypeError(f"agent factory {factory!r} cannot be sent to worker processes ({e}); "
                      "use a module-level class / function, or workers=0") from None
  if options.workers == 0:
    for cell in cells:
      finish(job.run(cell))
  elif options.threads:
    with concurrent.futures.ThreadPoolExecutor(options.workers) as pool:
      for record in pool.map(job.run, cells):
        finish(record)
  else:
    _parallel(cells, job, options, finish)
  return [done[c.key] for c in cells]
