"""The server launcher: waits for /health, captures logs, never leaves an orphan."""

from __future__ import annotations

import dataclasses

import os
import sys
import textwrap
import time

import httpx
import pytest

from bat_jax.rollout.sglang_launcher import (SGLangLaunchConfig, ServerProcess, ServerStartError,
                                             free_port, sglang_command)
from tests.rollout.process_checks import group_alive

# A stand-in server: starts a grandchild that would outlive a careless shutdown, then answers
# /health after a short warm-up (like SGLang loading weights).
FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print("grandchild", child.pid, flush=True)
    time.sleep(0.3)
    class H(http.server.BaseHTTPRequestHandler):
      def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
      def log_message(self, *a):
        print("request", self.path, flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie is dead for our purposes (its parent, the server, has exited too).
  with open(f"/proc/{pid}/stat") as f:
    return f.read().split(")")[-1].split()[0] != "Z"


def test_start_waits_for_health_and_stop_kills_the_whole_group(tmp_path):
  port = free_port()
  log = tmp_path / "server.log"
  server = ServerProcess([sys.executable, "-c", FAKE_SERVER, str(port)],
                         f"http://127.0.0.1:{port}", log, startup_timeout_s=30)
  with server:
    assert server.running()
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    pgid = server.pid
    grandchild = int(log.read_text().split("grandchild")[1].split()[0])
    assert _pid_alive(grandchild)
  assert not server.running()
  deadline = time.monotonic() + 5
  while _pid_alive(grandchild) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not _pid_alive(grandchild)
  assert not group_alive(pgid)
  assert "request /health" in log.read_text()


def test_a_server_that_dies_at_startup_reports_its_log(tmp_path):
  code = "import sys; print('CUDA out of memory while loading'); sys.exit(3)"
  server = ServerProcess([sys.executable, "-c", code], "http://127.0.0.1:9", tmp_path / "l.log",
                         startup_timeout_s=30)
  with pytest.raises(ServerStartError, match=r"exited with code 3(.|\n)*CUDA out of memory"):
    server.start()
  assert not server.running()


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped(tmp_path):
  server = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"],
                         f"http://127.0.0.1:{free_port()}", tmp_path / "l.log",
                         startup_timeout_s=1.0)
  with pytest.raises(ServerStartError, match="not healthy after 1s"):
    server.start()
  assert not server.running()


def test_sglang_command_line():
  cfg = SGLangLaunchConfig(model_path="/ckpt/step-5", port=30001, mem_fraction_static=0.55,
                           tp_size=2, dp_size=4, extra_args=("--disable-radix-cache",))
  cmd = sglang_command(cfg)
  assert cmd[1:3] == ["-m", "sglang.launch_server"]
  joined = " ".join(cmd)
  for part in ("--model-path /ckpt/step-5", "--port 30001", "--mem-fraction-static 0.55",
               "--tp-size 2", "--dp-size 4", "--disable-radix-cache", "--dtype bfloat16"):
    assert part in joined
  assert "--enable-memory-saver" not in cmd and "--context-length" not in cmd
  ours = sglang_command(dataclasses.replace(
      cfg, module="bat_jax.serve", dp_size=1, dtype="float32", context_length=512,
      random_seed=7, enable_memory_saver=True, python="/venv-sglang/bin/python"))
  assert ours[:3] == ["/venv-sglang/bin/python", "-m", "bat_jax.serve"]
  joined = " ".join(ours)
  for part in ("--dtype float32", "--context-length 512", "--random-seed 7",
               "--enable-memory-saver"):
    assert part in joined
  assert "--dp-size" not in ours
  with pytest.raises(ValueError, match="mem_fraction_static"):
    SGLangLaunchConfig(model_path="x", port=1, mem_fraction_static=1.5)
  with pytest.raises(ValueError, match="module = 'sglang.serve'"):
    SGLangLaunchConfig(model_path="x", port=1, module="sglang.serve")
  with pytest.raises(ValueError, match="dtype = 'auto'"):
    SGLangLaunchConfig(model_path="x", port=1, dtype="auto")
