"""The Stage Bank as a separate process, and the outer loop's client side.

Protocol (files only, in the bank directory):

- The outer loop calls `request_round(bank, round, weights)`, which atomically writes
  `BANK/requests/round_NNNNNN.json` = `{"round", "target", "weights"}`. Nothing else crosses:
  a request with any other field is refused.
- `serve` polls `BANK/requests/`, builds each unserved request (lowest round first) and publishes
  `BANK/round_NNNNNN/` atomically. A request that cannot be served (leak pre-check rejection, bad
  weights) gets `BANK/failed/round_NNNNNN.json` with the reason, so the client fails fast instead
  of timing out.
- The client's `wait_for_round(bank, round, timeout)` returns the published round directory.

Seed, batch count and the marker export are the server's own configuration, not the request's.
The outer loop requests round r+1 as soon as its weights are known, so synthesis overlaps the
trainer's evaluation and the trainer does not block on it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bat_jax import io_utils
from bat_jax.stagebank import build
from bat_jax.stagebank import leakcheck
from bat_jax.stagebank import rl_rows
from bat_jax.stagebank import rounds
from bat_jax.stagebank import shards

REQUESTS_DIR = "requests"
FAILED_DIR = "failed"
SERVER_FILE = "server.json"
REQUEST_FIELDS = frozenset({"round", "target", "weights"})
_REQUEST_RE = re.compile(r"^round_(\d{6})\.json$")


class RoundFailed(RuntimeError):
  """The bank could not serve a requested round (its failure file says why)."""


def _request_path(bank: Path, round_index: int) -> Path:
  return Path(bank) / REQUESTS_DIR / f"{shards.round_dirname(round_index)}.json"


def _failed_path(bank: Path, round_index: int) -> Path:
  return Path(bank) / FAILED_DIR / f"{shards.round_dirname(round_index)}.json"


def request_round(bank: Path, round_index: int, weights: rounds.RoundWeights, *,
                  target: str | None = None) -> Path:
  """Asks the bank for a round with the weights `curriculum.weights` returned.

  Re-requesting a round clears an earlier failure (the server tries again); re-requesting a
  published round with the same weights is a no-op.

  Returns:
    The request file.

  Raises:
    RoundExistsError: the round is already published with different weights.
  """
  if round_index < 0:
    raise ValueError(f"round must be >= 0, got {round_index}")
  if target is not None and target != weights.primary_stage:
    raise ValueError(f"target {target!r} disagrees with the weights' primary stage "
                     f"{weights.primary_stage!r}")
  _check_published_weights(bank, round_index, weights.to_json())
  request = {"round": round_index, "target": weights.primary_stage, "weights": weights.to_json()}
  _failed_path(bank, round_index).unlink(missing_ok=True)
  path = _request_path(bank, round_index)
  io_utils.atomic_write_json(path, request)
  return path


def _check_published_weights(bank: Path, round_index: int, weights: dict[str, Any]) -> None:
  final = Path(bank) / shards.round_dirname(round_index)
  if (final / shards.MANIFEST).is_file():
    published = shards.load_manifest(final)["curriculum_weights"]
    same = all(abs(published[group][k] - weights[group][k]) <= 1e-9
               for group in ("pool_mix", "stage_weights") for k in weights[group])
    if not same:
      raise shards.RoundExistsError(f"{final} is published with weights {published}, the "
                                    f"request has {weights}")


def wait_for_round(bank: Path, round_index: int, timeout: float, *, poll_s: float = 0.05) -> Path:
  """Blocks until the round is published; returns its directory.

  Raises:
    RoundFailed: the server wrote a failure file for this round.
    RoundExistsError: the published round's weights differ from the pending request's.
    RoundFormatError: the published folder's manifest is malformed or names another round.
    TimeoutError: nothing appeared within `timeout` seconds.
  """
  final = Path(bank) / shards.round_dirname(round_index)
  failed = _failed_path(bank, round_index)
  deadline = time.monotonic() + timeout
  while True:
    if (final / shards.MANIFEST).is_file():
      shards.load_manifest(final)  # a round copied in under this index is refused, named
      request = _request_path(bank, round_index)
      if request.is_file():
        _check_published_weights(bank, round_index, json.loads(request.read_text())["weights"])
      return final
    if failed.is_file():
      raise RoundFailed(f"bank {bank} failed round {round_index}: "
                        f"{json.loads(failed.read_text()).get('error')}")
    if time.monotonic() >= deadline:
      raise TimeoutError(f"round {round_index} did not appear in bank {bank} within {timeout}s "
                         f"(is `python -m bat_jax.stagebank serve --bank={bank}` running?)")
    time.sleep(poll_s)


def parse_request(path: Path) -> tuple[int, rounds.RoundWeights]:
  """Reads and validates one request file; errors name the file and the field at fault."""
  try:
    request = json.loads(Path(path).read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"request {path} is not valid JSON: {e}") from None
  if not isinstance(request, dict):
    raise ValueError(f"request {path} must be a JSON object")
  extra = set(request) - REQUEST_FIELDS
  if extra:
    raise ValueError(f"request {path} has fields {sorted(extra)}; only round, target and "
                     "weights may cross")
  if not isinstance(request.get("round"), int) or request["round"] < 0:
    raise ValueError(f"request {path}: field 'round' must be an int >= 0")
  if "weights" in request:
    weights = rounds.RoundWeights.from_json(request["weights"])
  elif request.get("target") is not None:
    weights = rounds.RoundWeights.for_target(request["target"])
  else:
    raise ValueError(f"request {path} needs field 'weights' or 'target'")
  if request.get("target") is not None and request["target"] != weights.primary_stage:
    raise ValueError(f"request {path}: field 'target' {request['target']!r} disagrees with the "
                     f"weights' primary stage {weights.primary_stage!r}")
  return request["round"], weights


def pending_requests(bank: Path) -> list[Path]:
  """Request files whose round is neither published nor failed, lowest round first."""
  req_dir = Path(bank) / REQUESTS_DIR
  if not req_dir.is_dir():
    return []
  out = []
  for path in sorted(req_dir.iterdir()):
    m = _REQUEST_RE.match(path.name)
    if not m:
      continue  # temp files of an in-progress atomic write, strays
    r = int(m.group(1))
    if not (Path(bank) / shards.round_dirname(r) / shards.MANIFEST).is_file() and \
        not _failed_path(bank, r).is_file():
      out.append(path)
  return out


def server_alive(bank: Path) -> bool:
  """Whether the server recorded in `BANK/server.json` is still running (same host)."""
  path = Path(bank) / SERVER_FILE
  if not path.is_file():
    return False
  try:
    os.kill(int(json.loads(path.read_text())["pid"]), 0)
  except (ProcessLookupError, ValueError, KeyError, json.JSONDecodeError):
    return False
  except PermissionError:
    return True
  return True


def _handle_request(bank: Path, path: Path, source: rl_rows.TaskSource, *, seed: int,
                    n_batches: int, rows_per_batch: int, markers_path: Path | None,
                    workers: int, allow_no_markers: bool = False) -> None:
  """Builds and publishes one request, or writes its failure file."""
  round_index = int(_REQUEST_RE.match(path.name).group(1))
  try:
    r, weights = parse_request(path)
    if r != round_index:
      raise ValueError(f"request {path}: field 'round' {r} does not match its file name")
    spec = rounds.RoundSpec(round_index, weights, seed=seed, n_batches=n_batches,
                            rows_per_batch=rows_per_batch)
    t0 = time.monotonic()
    out = build.build_and_publish(bank, spec, source, markers_path=markers_path, workers=workers,
                                  allow_no_markers=allow_no_markers)
    logging.info("published %s in %.2fs", out, time.monotonic() - t0)
  except leakcheck.RoundRejected as e:
    logging.error("%s", e)
    io_utils.atomic_write_json(_failed_path(bank, round_index),
                             {"error": str(e), "leak_receipt": e.receipt.to_json()})
  except Exception as e:  # noqa: BLE001 - any failure must reach the client, not kill serving
    logging.exception("request %s failed", path)
    io_utils.atomic_write_json(_failed_path(bank, round_index),
                             {"error": f"{type(e).__name__}: {e}"})


def serve(bank: Path, source_factory: Callable[[], rl_rows.TaskSource], *, seed: int = 0,
          n_batches: int = rounds.REFERENCE_BATCHES,
          rows_per_batch: int = rounds.REFERENCE_ROWS_PER_BATCH,
          markers_path: Path | None = None, poll_s: float = 0.2,
          max_rounds: int | None = None, workers: int = 1, allow_no_markers: bool = False,
          stop: threading.Event | None = None) -> int:
  """Serves round requests until SIGTERM/SIGINT, `stop` is set or `max_rounds` requests were
  handled; returns the number handled. Signals are caught only when run in the main thread."""
  bank = Path(bank)
  bank.mkdir(parents=True, exist_ok=True)
  stop = stop if stop is not None else threading.Event()
  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, lambda *_: stop.set())
  server_file = bank / SERVER_FILE
  io_utils.atomic_write_json(server_file, {"pid": os.getpid(), "seed": seed,
                                         "n_batches": n_batches, "rows_per_batch": rows_per_batch})
  source = source_factory()
  handled = 0
  logging.info("stagebank serving %s (seed=%d, n_batches=%d)", bank, seed, n_batches)
  try:
    while not stop.is_set() and (max_rounds is None or handled < max_rounds):
      todo = pending_requests(bank)
      if not todo:
        # Not `stop.wait`: the signal handler's `stop.set()` takes the Event's lock, and a
        # signal landing while this thread held it inside `wait` deadlocked the server for good
        # (a bank orphaned by a killed run, stuck in a futex).
        time.sleep(poll_s)
        continue
      _handle_request(bank, todo[0], source, seed=seed, n_batches=n_batches,
                      rows_per_batch=rows_per_batch, markers_path=markers_path, workers=workers,
                      allow_no_markers=allow_no_markers)
      handled += 1
  finally:
    server_file.unlink(missing_ok=True)
  return handled
