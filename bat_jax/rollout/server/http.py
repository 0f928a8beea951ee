"""The HTTP transport of `bat_jax.rollout.server`: a hardened stdlib request handler served by a
bounded worker pool whose selector reads headers first, under a deadline (`pool`).

Junk is answered with a 4xx, quickly, and without growing the process: the body size is capped
(413) before anything is read, Content-Length must be a plain decimal (chunked bodies are
refused with 411), a body that stops arriving is answered with 408 after `body_timeout_s` of
silence, JSON that nests too deeply or holds NaN / Infinity / 5000-digit integers is a 400, and
methods the server does not serve are a 405. Streams are server-sent events; a client that goes
away is noticed (peer EOF or a failed write) and its request is cancelled.
"""

from __future__ import annotations

import io
import json
import logging
import re
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any, Iterator

from bat_jax.rollout.server.app import ServeApp, error
from bat_jax.rollout.server.pool import MAX_HEADER_BYTES, PooledHTTPServer, PrefixedSocketIO

log = logging.getLogger("bat_jax.serve")

DEFAULT_MAX_BODY_BYTES = 16 << 20
_DECIMAL = re.compile(r"[0-9]{1,15}")
_READ_CHUNK = 1 << 16


class _BadBody(Exception):
  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


def _reject_constant(name: str):
  raise ValueError(f"{name} is not a valid JSON number (non-finite values are refused)")


def parse_json(raw: bytes) -> Any:
  try:
    return json.loads(raw, parse_constant=_reject_constant) if raw else {}
  except RecursionError:
    raise _BadBody(400, "request body is not valid JSON: nested too deeply") from None
  except ValueError as e:  # JSONDecodeError, bad UTF-8, NaN/Infinity, huge integers
    raise _BadBody(400, f"request body is not valid JSON: {str(e)[:300]}") from None


class Handler(BaseHTTPRequestHandler):
  """Set on a subclass by `make_server`: app, max_body_bytes, body_timeout_s, idle_timeout_s."""
  app: ServeApp
  max_body_bytes = DEFAULT_MAX_BODY_BYTES
  body_timeout_s = 1.0
  timeout = 60.0  # idle keep-alive connections and slow headers are dropped after this
  protocol_version = "HTTP/1.1"
  default_request_version = "HTTP/1.0"  # junk request lines still get a status line (400)

  def __init__(self, request, client_address, server, rfile_prefix: bytes = b""):
    self._prefix = rfile_prefix
    super().__init__(request, client_address, server)

  def setup(self):
    super().setup()
    self.connection.settimeout(self.timeout)
    self.rfile = io.BufferedReader(PrefixedSocketIO(self.connection, self._prefix))

  def handle(self):
    """One request per handler: the pool hands a kept-alive connection back to its selector."""
    self.close_connection = True
    self.handle_one_request()

  def finish(self):
    """Keeps the bytes of a next (pipelined) request already read, for the pool's selector."""
    self.next_prefix = b""
    if not self.close_connection:
      self.connection.setblocking(False)
      try:
        self.next_prefix = self.rfile.peek(MAX_HEADER_BYTES)
      except (BlockingIOError, OSError, ValueError):
        pass
    super().finish()

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    log.debug("%s %s", self.address_string(), format % args)

  def _send(self, status: int, payload: Any, close: bool = False) -> None:
    data = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    if close:
      self.send_header("Connection", "close")
      self.close_connection = True
    self.end_headers()
    self.wfile.write(data)

  def _read_body(self) -> bytes:
    if self.headers.get("Transfer-Encoding"):
      raise _BadBody(411, "Transfer-Encoding bodies are not supported; send Content-Length")
    values = self.headers.get_all("Content-Length") or []
    if not values:
      return b""
    if len(values) > 1 or not _DECIMAL.fullmatch(values[0].strip()):
      raise _BadBody(400, f"Content-Length must be one non-negative decimal integer, got "
                     f"{values[:2]!r}"[:300])
    length = int(values[0])
    if length > self.max_body_bytes:
      raise _BadBody(413, f"request body of {length} bytes exceeds the "
                     f"{self.max_body_bytes}-byte limit (--max-body-mb)")
    chunks, got = [], 0
    self.connection.settimeout(self.body_timeout_s)
    try:
      while got < length:
        piece = self.rfile.read1(min(_READ_CHUNK, length - got))
        if not piece:
          break
        chunks.append(piece)
        got += len(piece)
    except (socket.timeout, TimeoutError):
      pass
    finally:
      self.connection.settimeout(self.timeout)
    if got < length:
      raise _BadBody(408, f"request body incomplete: got {got} of {length} bytes "
                     f"(Content-Length) before {self.body_timeout_s}s of silence")
    return b"".join(chunks)

  def client_gone(self) -> bool:
    """True when the peer closed its end (a pipelined next request does not count)."""
    try:
      readable, _, _ = select.select([self.connection], [], [], 0)
      return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
      return True

  def _serve(self, method: str) -> None:
    body = None
    if method == "POST":
      try:
        body = parse_json(self._read_body())
      except _BadBody as e:
        self._send(e.status, error(str(e)), close=e.status in (408, 411, 413) or
                   e.status == 400 and "Content-Length" in str(e))
        return
    try:
      status, payload = self.app.handle(method, self.path, body, self.client_gone,
                                        self.headers.get("Authorization"))
    except Exception as e:  # pylint: disable=broad-except
      log.exception("%s %s failed", method, self.path)
      status, payload = 500, error(f"internal error: {type(e).__name__}: {e}"[:2000])
    if isinstance(payload, Iterator):
      self._stream(payload)
    else:
      self._send(status, payload)

  def _stream(self, events: Iterator[dict]) -> None:
    """Server-sent events, one `data:` line per event, then `data: [DONE]`."""
    self.send_response(200)
    self.send_header("Content-Type", "text/event-stream")
    self.send_header("Cache-Control", "no-cache")
    self.send_header("Connection", "close")
    self.close_connection = True
    self.end_headers()
    try:
      for event in events:
        if self.client_gone():
          break
        self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.flush()
      else:
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
    except (BrokenPipeError, ConnectionResetError, socket.timeout, OSError):
      log.info("client went away mid-stream; its request is cancelled")
    finally:
      events.close()  # cancels the request's jobs: their slots go to others

  def do_GET(self):  # noqa: N802 (http.server naming)
    self._serve("GET")

  def do_POST(self):  # noqa: N802
    self._serve("POST")

  def _not_allowed(self):
    self.close_connection = True
    self._send(405, error(f"method {self.command} is not allowed; use GET or POST"), close=True)

  do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed  # noqa: N815


def make_server(app: ServeApp, host: str = "127.0.0.1", port: int = 0, *,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = 1.0,
                max_connections: int = 64, header_timeout_s: float = 5.0) -> PooledHTTPServer:
  """An HTTP server bound to (host, port); port 0 picks a free one (see server_address).

  `max_connections` workers serve requests; headers are read before a worker is taken, and a
  client that has not sent them within `header_timeout_s` is answered 408 (see `pool`)."""
  handler = type("BoundHandler", (Handler,), {"app": app, "max_body_bytes": max_body_bytes,
                                              "body_timeout_s": body_timeout_s})
  return PooledHTTPServer((host, port), handler, max_connections=max_connections,
                          header_timeout_s=header_timeout_s)


def serve_in_thread(app: ServeApp, host: str = "127.0.0.1", port: int = 0, **kwargs
                    ) -> tuple[PooledHTTPServer, str]:
  """Starts the server on a daemon thread; returns it and its base URL."""
  server = make_server(app, host, port, **kwargs)
  threading.Thread(target=server.serve_forever, name="bat-jax-serve", daemon=True).start()
  h, p = server.server_address[:2]
  return server, f"http://{h}:{p}"
