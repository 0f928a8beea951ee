"""The train step waits until a released rollout server's GPU memory really shows as free."""

import time

import pytest

from bat_jax.bicurl.policy import SGLangPolicyServer
from bat_jax.rollout import free_port, gpu_memory
from bat_jax.run_config import RunConfig
from configs import tiny


class _Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t

  def sleep(self, dt):
    self.t += dt


def _probe(readings):
  it = iter(readings)
  return lambda: next(it)


def test_waits_until_the_memory_dropped_and_settled():
  clock = _Clock()
  # SGLang answered, but the pages come back over the next polls.
  probe = _probe([[40_000, 40_000], [30_000, 38_000], [2_100, 2_000], [2_080, 2_010]])
  got = gpu_memory.wait_for_release(probe, [40_000, 40_000], timeout_s=10, poll_s=0.5,
                                    clock=clock, sleep=clock.sleep)
  assert got == [2_080, 2_010] and clock.t == 1.5  # the 4th reading, 3 polls of 0.5 s


def test_memory_that_never_comes_back_is_a_clear_error():
  clock = _Clock()
  probe = lambda: [39_990]
  with pytest.raises(TimeoutError, match=r"within 3 s .*before \[40000\], now \[39990\].*"
                                         r"rollout.sglang.release_timeout_s"):
    gpu_memory.wait_for_release(probe, [40_000], timeout_s=3, poll_s=1, clock=clock,
                                sleep=clock.sleep)
  assert clock.t == 3


def test_no_gpu_reading_means_nothing_to_wait_for():
  assert gpu_memory.wait_for_release(lambda: None, None, timeout_s=1) is None


class _Engine:
  def __init__(self, log):
    self.log = log

  def release_memory(self):
    self.log.append("release")

  def close(self):
    pass


def test_rollouts_done_reads_before_the_release_and_returns_once_it_settled(tmp_path):
  cfg = tiny.get_config("smoke")
  with cfg.unlocked():
    cfg.rollout.engine = "sglang"
    cfg.rollout.sglang.launch = False
    cfg.rollout.sglang.urls = (f"http://127.0.0.1:{free_port()}",)
    cfg.rollout.sglang.release_memory = True
    cfg.rollout.sglang.release_timeout_s = 5.0
  events, readings = [], iter([[50_000], [50_000], [3_000], [3_000]])

  def probe():
    events.append("read")
    return next(readings)

  server = SGLangPolicyServer(None, RunConfig.from_config(cfg), tmp_path / "w", tmp_path / "t",
                              tmp_path / "log", gpu_probe=probe)
  server.engine.close()
  server.engine = _Engine(events)
  start = time.monotonic()
  server.rollouts_done()
  assert events == ["read", "release", "read", "read", "read"]
  assert server.memory_released and time.monotonic() - start < 5
  server.rollouts_done()  # already released: no second release, no wait
  assert events.count("release") == 1
