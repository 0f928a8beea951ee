"""The bank as a real separate process: requests in, atomically published rounds out."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from synthetic_source import SyntheticSource

from bat_jax import io_utils, markers
from bat_jax.stagebank import build
from bat_jax.stagebank import daemon
from bat_jax.stagebank import reader
from bat_jax.stagebank import rounds
from bat_jax.stagebank import shards

REPO = Path(__file__).resolve().parents[2]


def _watch_for_partial_rounds(bank: Path, stop: threading.Event, violations: list):
  """Every round directory a reader can see must already be complete and verifiable."""
  while not stop.is_set():
    for r in shards.published_rounds(bank):
      try:
        shards.verify_round(bank / shards.round_dirname(r))
      except Exception as e:  # noqa: BLE001 - any failure is a visible half-written round
        violations.append(repr(e))
    stop.wait(0.01)


@pytest.fixture
def server(tmp_path):
  bank = tmp_path / "bank"
  bank.mkdir()  # the leak pre-check fails closed: the bank needs a marker export
  io_utils.atomic_write_json(bank / "markers.json",
                             markers.export_markers(["unrelated-heldout-9931"], salt="bank"))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.Popen(
      [sys.executable, "-m", "bat_jax.stagebank", "serve", f"--bank={bank}", "--n-batches=6",
       "--seed=3", "--poll-s=0.05", "--source=synthetic_source:SyntheticSource"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  yield bank, proc
  if proc.poll() is None:
    proc.kill()
    proc.wait()


def test_serve_publishes_requests_atomically_and_fails_fast(server):
  bank, proc = server
  stop, violations = threading.Event(), []
  watcher = threading.Thread(target=_watch_for_partial_rounds, args=(bank, stop, violations))
  watcher.start()
  try:
    weights = rounds.RoundWeights({"s_target": 0.5, "s_mix": 0.25, "e2e": 0.25},
                                  {"S1": 0.0, "S2": 0.0, "S3": 0.0, "S4": 0.0, "S5": 1.0})
    daemon.request_round(bank, 0, weights, target="S5")
    round_dir = daemon.wait_for_round(bank, 0, timeout=60)
    manifest = shards.verify_round(round_dir)
    assert manifest["round_target"] == "S5" and manifest["config"]["seed"] == 3
    batches = list(reader.RoundReader(round_dir))
    assert len(batches) == 6
    assert all(r["extra_info"]["target_stage"] == "S5" for b in batches for r in b[:4])

    # A request carrying anything but round/target/weights is refused, naming the field.
    req_dir = bank / daemon.REQUESTS_DIR
    io_utils.atomic_write_json(req_dir / "round_000001.json", {
        "round": 1, "target": "S1", "weights": rounds.RoundWeights.for_target("S1").to_json(),
        "heldout_scores": [0.1]})
    with pytest.raises(daemon.RoundFailed, match="heldout_scores"):
      daemon.wait_for_round(bank, 1, timeout=60)

    # A leak found by the server's pre-check fails the round whole; nothing is published.
    io_utils.atomic_write_json(bank / "markers.json",
                             markers.export_markers(["task/spec.json"], salt="bank"))
    daemon.request_round(bank, 2, rounds.RoundWeights.for_target("S2"))
    with pytest.raises(daemon.RoundFailed, match="heldout_marker"):
      daemon.wait_for_round(bank, 2, timeout=60)
    failure = json.loads((bank / daemon.FAILED_DIR / "round_000002.json").read_text())
    assert failure["leak_receipt"]["rows_rejected"] == 48
    assert shards.published_rounds(bank) == [0]
    assert daemon.server_alive(bank)
  finally:
    stop.set()
    watcher.join()
  assert violations == []
  assert not [p for p in bank.iterdir() if p.name.startswith(".tmp")]
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=30)
  assert proc.returncode == 0, out
  assert not daemon.server_alive(bank)


def test_wait_for_round_times_out_naming_the_bank(tmp_path):
  with pytest.raises(TimeoutError, match="round 9 did not appear"):
    daemon.wait_for_round(tmp_path, 9, timeout=0.1)
  with pytest.raises(ValueError, match="disagrees"):
    daemon.request_round(tmp_path, 0, rounds.RoundWeights.for_target("S3"), target="S1")


def test_request_conflicting_with_a_published_round_is_refused(tmp_path, source, checker):
  spec = rounds.RoundSpec(0, rounds.RoundWeights.for_target("S3"), n_batches=1)
  build.publish(tmp_path, build.build_round(spec, source, checker), source_name=source.name)
  daemon.request_round(tmp_path, 0, spec.weights)  # same weights: fine, already served
  assert daemon.wait_for_round(tmp_path, 0, timeout=1) == tmp_path / "round_000000"
  with pytest.raises(shards.RoundExistsError, match="round_000000"):
    daemon.request_round(tmp_path, 0, rounds.RoundWeights.for_target("S1"))


def test_serve_in_a_thread_stops_on_its_event(tmp_path):
  stop = threading.Event()
  thread = threading.Thread(target=daemon.serve, args=(tmp_path, SyntheticSource),
                            kwargs=dict(n_batches=1, poll_s=0.01, stop=stop,
                                        allow_no_markers=True))
  thread.start()
  daemon.request_round(tmp_path, 3, rounds.RoundWeights.for_target("S1"))
  assert daemon.wait_for_round(tmp_path, 3, timeout=30).name == "round_000003"
  assert daemon.server_alive(tmp_path)
  stop.set()
  thread.join(timeout=10)
  assert not thread.is_alive() and not daemon.server_alive(tmp_path)


def test_sigterm_during_the_idle_poll_stops_the_server(tmp_path, monkeypatch):
  """SIGTERM (a killed run's PR_SET_PDEATHSIG) landing in the idle poll ends the server: the
  poll must not hold the lock the handler's `stop.set()` takes (it once deadlocked a bank)."""
  polls = []

  def sleep(seconds):
    polls.append(seconds)
    if len(polls) == 3:
      os.kill(os.getpid(), signal.SIGTERM)  # delivered inside the poll, as the kernel's would be

  monkeypatch.setattr(daemon, "time", type("FakeTime", (), {"sleep": staticmethod(sleep)}))
  handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  stop = threading.Event()
  backstop = threading.Timer(10.0, stop.set)  # a poll that bypasses `time.sleep` fails, not hangs
  backstop.start()
  try:
    handled = daemon.serve(tmp_path / "bank", lambda: None, poll_s=0.01, stop=stop)
  finally:
    backstop.cancel()
    for sig, handler in handlers.items():
      signal.signal(sig, handler)
  assert handled == 0 and polls == [0.01] * 3
  assert not daemon.server_alive(tmp_path / "bank")
