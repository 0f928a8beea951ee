"""Starts and stops an inference server subprocess (SGLang, or `bat_jax.serve` on CPU).

`rollout.sglang.server_module` picks the server: `sglang.launch_server` (GPU; run by the
interpreter of its own venv, `rollout.sglang.python`) or `bat_jax.serve` (our SGLang-protocol
server over the JAX engine; accepts the same launch flags). Both get the same command line.

The server runs in its own process group (`start_new_session`) and gets SIGTERM if this
process dies (Linux `PR_SET_PDEATHSIG`), so neither a clean `stop()` nor a crashed trainer
leaves an orphan: `stop()` sends SIGTERM to the whole group, waits, then SIGKILLs the group.
stdout and stderr go to a log file whose tail is quoted in every startup error.

GPU memory (SGLang 0.5.23, `kv_cache_configurator._profile_available_bytes`):
`mem_fraction_static` is a fraction of the memory FREE when the server starts, not of the GPU.
Started after the JAX trainer has preallocated `XLA_PYTHON_CLIENT_MEM_FRACTION` = x of the
GPU, the server's weights + KV pool get `mem_fraction_static * (1 - x)` of it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Mapping, Optional, Sequence

import httpx


class ServerStartError(RuntimeError):
  """The server exited or never became healthy."""


SERVER_MODULES = ("sglang.launch_server", "bat_jax.serve")
SERVING_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class SGLangLaunchConfig:
  """Arguments of `python -m sglang.launch_server` (or `-m bat_jax.serve`, same flags).

  Attributes:
    dtype: `--dtype`; export the weights in the same dtype (SGLang serves a float32
      config.json as float16 under `--dtype auto`).
    mem_fraction_static: fraction of the GPU memory free at start-up for weights + KV.
    context_length: `--context-length` (None: the model's own).
    random_seed: `--random-seed` (None: the server picks).
    enable_memory_saver: `--enable-memory-saver`, needed by `/release_memory_occupation`.
    module: one of SERVER_MODULES.
    python: the server's interpreter (its own venv for SGLang).
  """
  model_path: str
  port: int
  host: str = "127.0.0.1"
  dtype: str = "bfloat16"
  mem_fraction_static: float = 0.8
  tp_size: int = 1
  dp_size: int = 1
  context_length: Optional[int] = None
  random_seed: Optional[int] = None
  enable_memory_saver: bool = False
  module: str = "sglang.launch_server"
  extra_args: tuple[str, ...] = ()
  python: str = sys.executable

  def __post_init__(self):
    if not 0 < self.mem_fraction_static <= 1:
      raise ValueError(f"mem_fraction_static = {self.mem_fraction_static} not in (0, 1]")
    for name in ("tp_size", "dp_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} = {getattr(self, name)} must be >= 1")
    if self.module not in SERVER_MODULES:
      raise ValueError(f"module = {self.module!r} is not one of {SERVER_MODULES}")
    if self.dtype not in SERVING_DTYPES:
      raise ValueError(f"dtype = {self.dtype!r} is not one of {SERVING_DTYPES}")


def sglang_command(cfg: SGLangLaunchConfig) -> list[str]:
  """The command line that launches the server for `cfg` (SGLang 0.5.23's flag names)."""
  cmd = [cfg.python, "-m", cfg.module, "--model-path", cfg.model_path,
         "--host", cfg.host, "--port", str(cfg.port), "--dtype", cfg.dtype,
         "--mem-fraction-static", str(cfg.mem_fraction_static), "--tp-size", str(cfg.tp_size)]
  if cfg.dp_size != 1:
    cmd += ["--dp-size", str(cfg.dp_size)]
  if cfg.context_length is not None:
    cmd += ["--context-length", str(cfg.context_length)]
  if cfg.random_seed is not None:
    cmd += ["--random-seed", str(cfg.random_seed)]
  if cfg.enable_memory_saver:
    cmd.append("--enable-memory-saver")
  return cmd + list(cfg.extra_args)


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port nothing listens on right now."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


try:  # loaded here, in the parent: the child may only make async-signal-safe calls
  _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # pragma: no cover - not glibc Linux
  _LIBC = None


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
  """Asks the kernel to SIGTERM the child when its parent dies (Linux PR_SET_PDEATHSIG)."""
  if _LIBC is not None:
    _LIBC.prctl(1, signal.SIGTERM)


class ServerProcess:
  """One server subprocess; a context manager that always stops it.

  Args:
    command: argv of the server.
    base_url: where it listens, e.g. "http://127.0.0.1:30000".
    log_path: file receiving the server's stdout and stderr.
    env: extra environment variables.
    startup_timeout_s: how long `start()` waits for `/health` to answer 200.
  """

  def __init__(self, command: Sequence[str], base_url: str, log_path: Path, *,
               env: Optional[Mapping[str, str]] = None, startup_timeout_s: float = 600.0):
    self.command = list(command)
    self.base_url = base_url.rstrip("/")
    self.log_path = Path(log_path)
    self.env = dict(env or {})
    self.startup_timeout_s = startup_timeout_s
    self._proc: Optional[subprocess.Popen] = None

  @classmethod
  def sglang(cls, cfg: SGLangLaunchConfig, log_path: Path, **kwargs) -> "ServerProcess":
    return cls(sglang_command(cfg), f"http://{cfg.host}:{cfg.port}", log_path, **kwargs)

  @property
  def pid(self) -> Optional[int]:
    return None if self._proc is None else self._proc.pid

  def running(self) -> bool:
    return self._proc is not None and self._proc.poll() is None

  def log_tail(self, n_chars: int = 4000) -> str:
    try:
      return self.log_path.read_text(errors="replace")[-n_chars:]
    except FileNotFoundError:
      return "(no log written)"

  def start(self) -> "ServerProcess":
    """Launches the server and blocks until `/health` answers 200."""
    if self.running():
      raise ServerStartError(f"server already running (pid {self.pid})")
    self.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(self.log_path, "ab") as log_file, warnings.catch_warnings():
      # preexec_fn forces fork(); the child only calls prctl() and then exec()s, so JAX's
      # "fork in a multithreaded process" warning does not apply.
      warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
      self._proc = subprocess.Popen(
          self.command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          env={**os.environ, **self.env}, start_new_session=True, preexec_fn=die_with_parent)
    try:
      self._wait_healthy()
    except BaseException:
      self.stop()
      raise
    return self

  def _wait_healthy(self) -> None:
    deadline = time.monotonic() + self.startup_timeout_s
    delay = 0.1
    with httpx.Client(base_url=self.base_url, timeout=5.0) as http:
      while True:
        code = self._proc.poll()
        if code is not None:
          raise ServerStartError(
              f"server {self.command[:3]} exited with code {code} before becoming healthy; "
              f"log {self.log_path}:\n{self.log_tail()}")
        try:
          if http.get("/health").status_code == 200:
            return
        except httpx.HTTPError:
          pass
        if time.monotonic() > deadline:
          raise ServerStartError(
              f"server at {self.base_url} not healthy after {self.startup_timeout_s:.0f}s; "
              f"log {self.log_path}:\n{self.log_tail()}")
        time.sleep(delay)
        delay = min(2.0, delay * 1.5)

  def stop(self, timeout_s: float = 30.0) -> Optional[int]:
    """SIGTERM the process group, wait, SIGKILL what is left; returns the exit code."""
    proc = self._proc
    if proc is None:
      return None
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    _signal_group(pgid, signal.SIGTERM)
    try:
      proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      pass
    # Children of the server (schedulers, detokenizers) may outlive the leader.
    _signal_group(pgid, signal.SIGKILL)
    code = proc.wait()
    self._proc = None
    return code

  def __enter__(self) -> "ServerProcess":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def _signal_group(pgid: int, sig: int) -> None:
  try:
    os.killpg(pgid, sig)
  except ProcessLookupError:
    pass
