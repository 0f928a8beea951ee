"""The outer loop's handle on the Stage Bank process: spawn or connect, request, wait.

The bank is a separate process (`python -m bat_jax.stagebank serve`) that talks to the trainer
through files only (`bat_jax.stagebank.daemon`). It holds the evaluator's *hashed* marker export,
never the held-out cells.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Optional


from bat_jax.run_config import RunConfig
from bat_jax.evaluator.markers_export import export_cells, write_export
from bat_jax.rollout.sglang_launcher import die_with_parent  # PR_SET_PDEATHSIG helper
from bat_jax.stagebank import daemon as bank_daemon
from bat_jax.stagebank import task_source
from bat_jax.stagebank.rounds import RoundWeights

log = logging.getLogger(__name__)


def write_markers(cfg: RunConfig, path: Path) -> Path:
  """The held-out cells' hashed markers for the bank's leak check (written once per run): the
  gate's cells and the held-back ones."""
  if not path.is_file():
    write_export(export_cells(cfg.heldout_cells()), path)
  return path


class StageBank:
  """A running Stage Bank: spawned here (`stagebank.mode = spawn`) or already running (`connect`).

  Args:
    bank_dir: the bank directory.
    process: the spawned server, or None when connected to one running elsewhere.
    timeout_s: how long `wait` waits for a round.
  """

  def __init__(self, bank_dir: Path, process: Optional[subprocess.Popen], timeout_s: float,
               log_path: Optional[Path] = None):
    self.bank_dir = Path(bank_dir)
    self.process = process
    self.timeout_s = timeout_s
    self.log_path = log_path

  @classmethod
  def start(cls, cfg: RunConfig, bank_dir: Path, markers_path: Path,
            log_path: Path) -> "StageBank":
    """Spawns `python -m bat_jax.stagebank serve` (one batch = `grpo.prompt_groups` rows), or
    connects to the server of `stagebank.dir`."""
    if cfg.stagebank.mode == "connect":
      if not bank_daemon.server_alive(bank_dir):
        log.warning("no live Stage Bank server recorded in %s; requests wait for one", bank_dir)
      return cls(bank_dir, None, cfg.stagebank.request_timeout_s)
    bank_dir.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "bat_jax.stagebank", "serve", f"--bank={bank_dir}",
            f"--seed={cfg.stagebank.seed}", f"--n-batches={cfg.stagebank.n_batches}",
            f"--rows-per-batch={cfg.grpo.prompt_groups}", f"--markers={markers_path}",
            "--poll-s=0.1", f"--source={task_source.source_spec(cfg.workflow.action_space)}"]
    with open(log_path, "ab") as out, warnings.catch_warnings():
      # The child only calls prctl() between fork and exec (see sglang_launcher).
      warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
      # It dies with the trainer, so a SIGKILLed run leaves no server behind to race the
      # next one over the bank directory.
      process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    log.info("Stage Bank spawned (pid %d): %s", process.pid, " ".join(argv))
    return cls(bank_dir, process, cfg.stagebank.request_timeout_s, log_path)

  def request(self, round_index: int, weights: RoundWeights) -> None:
    """Asks for a round as soon as its weights are known (synthesis overlaps training)."""
    bank_daemon.request_round(self.bank_dir, round_index, weights)

  def wait(self, round_index: int) -> Path:
    """The published round directory; fails fast if the spawned server died."""
    deadline = time.monotonic() + self.timeout_s
    while True:
      if self.process is not None and self.process.poll() is not None:
        try:  # it may have published just before exiting
          return bank_daemon.wait_for_round(self.bank_dir, round_index, 0.0)
        except TimeoutError:
          tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path else ""
          raise RuntimeError(f"the Stage Bank process exited with code {self.process.returncode}"
                             f" before publishing round {round_index}; its log ends:\n{tail}"
                             ) from None
      try:
        return bank_daemon.wait_for_round(self.bank_dir, round_index,
                                         min(1.0, max(0.0, deadline - time.monotonic())))
      except TimeoutError:
        if time.monotonic() >= deadline:
          raise

  def close(self) -> None:
    """Stops a spawned server (SIGTERM, then SIGKILL)."""
    if self.process is None or self.process.poll() is not None:
      return
    self.process.terminate()
    try:
      self.process.wait(10)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait()

  def __enter__(self) -> "StageBank":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
