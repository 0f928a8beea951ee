"""Connections for `bat_jax.rollout.server.http`: a header reader and a bounded worker pool.

One selector thread accepts connections and reads request headers without blocking; only a
connection whose headers are complete goes to one of `max_connections` worker threads. So
clients that connect and send nothing (or half a header) hold no worker: they are answered 408
and closed after `header_timeout_s`, and `/health` or `/generate` from others is served at once.
A kept-alive connection returns to the selector between requests (idle ones are dropped after
`idle_timeout_s`). At most `max_pending` connections wait for their headers; more are refused.
"""

from __future__ import annotations

import io
import logging
import queue
import selectors
import socket
import threading
import time
from typing import Any, Optional

log = logging.getLogger("bat_jax.serve")

MAX_HEADER_BYTES = 64 << 10
_TIMEOUT_BODY = b'{"error": {"message": "request headers not received in time"}}'
_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
                % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
_TOO_LARGE_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
                  b"Content-Length: 0\r\n\r\n")


class PrefixedSocketIO(io.RawIOBase):
  """Reads the bytes the selector already read, then the socket."""

  def __init__(self, sock: socket.socket, prefix: bytes):
    self._sock, self._prefix = sock, prefix

  def readable(self) -> bool:
    return True

  def readinto(self, b) -> Optional[int]:
    if self._prefix:
      n = min(len(b), len(self._prefix))
      b[:n], self._prefix = self._prefix[:n], self._prefix[n:]
      return n
    try:
      return self._sock.recv_into(b)
    except BlockingIOError:
      return None


class PooledHTTPServer:
  """Serves `handler_cls` on (host, port): a BaseHTTPRequestHandler that handles one request
  per instance, reads `rfile_prefix` first and leaves `next_prefix` (bytes of a pipelined next
  request); serve_forever / shutdown / server_close / server_address as socketserver's."""

  def __init__(self, address: tuple[str, int], handler_cls: Any, *, max_connections: int,
               header_timeout_s: float, idle_timeout_s: float = 60.0,
               max_pending: int = 4096):
    self.handler_cls = handler_cls
    self.header_timeout_s, self.idle_timeout_s = header_timeout_s, idle_timeout_s
    self.max_pending = max_pending
    self.socket = socket.create_server(address, backlog=1024, reuse_port=False)
    self.socket.setblocking(False)
    self.server_address = self.socket.getsockname()
    self._ready: queue.Queue = queue.Queue()        # (sock, address, prefix) for workers
    self._returned: queue.Queue = queue.Queue()     # kept-alive sockets back to the selector
    self._stop = threading.Event()
    self._stopped = threading.Event()
    self._workers = [threading.Thread(target=self._work, name=f"serve-worker-{i}", daemon=True)
                     for i in range(max_connections)]
    for w in self._workers:
      w.start()

  # -- the selector thread ---------------------------------------------------------------------

  def serve_forever(self, poll_interval: float = 0.05) -> None:
    sel = selectors.DefaultSelector()
    sel.register(self.socket, selectors.EVENT_READ)
    waiting: dict[socket.socket, list] = {}   # sock -> [address, bytearray, deadline]
    try:
      while not self._stop.is_set():
        self._take_returned(sel, waiting)
        for key, _ in sel.select(timeout=poll_interval):
          if key.fileobj is self.socket:
            self._accept(sel, waiting)
          else:
            self._read_headers(sel, waiting, key.fileobj)
        now = time.monotonic()
        for sock in [s for s, w in waiting.items() if w[2] < now]:
          self._drop(sel, waiting, sock, _TIMEOUT_408 if waiting[sock][1] else b"")
    finally:
      for sock in list(waiting):
        self._drop(sel, waiting, sock, b"")
      sel.close()
      self._stopped.set()

  def _accept(self, sel, waiting) -> None:
    while True:
      try:
        sock, address = self.socket.accept()
      except (BlockingIOError, InterruptedError):
        return
      if len(waiting) >= self.max_pending:
        sock.close()
        continue
      sock.setblocking(False)
      sel.register(sock, selectors.EVENT_READ)
      waiting[sock] = [address, bytearray(), time.monotonic() + self.header_timeout_s]

  def _take_returned(self, sel, waiting) -> None:
    while True:
      try:
        sock, address, prefix = self._returned.get_nowait()
      except queue.Empty:
        return
      sock.setblocking(False)
      timeout = self.header_timeout_s if prefix else self.idle_timeout_s
      waiting[sock] = [address, bytearray(prefix), time.monotonic() + timeout]
      sel.register(sock, selectors.EVENT_READ)
      if b"\r\n\r\n" in prefix:  # a pipelined request is already here
        self._dispatch(sel, waiting, sock)

  def _read_headers(self, sel, waiting, sock) -> None:
    entry = waiting[sock]
    try:
      data = sock.recv(1 << 16)
    except (BlockingIOError, InterruptedError):
      return
    except OSError:
      data = b""
    if not data:
      self._drop(sel, waiting, sock, b"")
      return
    if not entry[1]:  # the first byte of a request starts its header deadline
      entry[2] = min(entry[2], time.monotonic() + self.header_timeout_s)
    entry[1] += data
    if b"\r\n\r\n" in entry[1] or b"\n\n" in entry[1]:
      self._dispatch(sel, waiting, sock)
    elif len(entry[1]) > MAX_HEADER_BYTES:
      self._drop(sel, waiting, sock, _TOO_LARGE_431)

  def _dispatch(self, sel, waiting, sock) -> None:
    address, prefix, _ = waiting.pop(sock)
    sel.unregister(sock)
    sock.setblocking(True)
    self._ready.put((sock, address, bytes(prefix)))

  @staticmethod
  def _drop(sel, waiting, sock, reply: bytes) -> None:
    waiting.pop(sock, None)
    try:
      sel.unregister(sock)
    except (KeyError, ValueError):
      pass
    try:
      if reply:
        sock.send(reply)
    except OSError:
      pass
    sock.close()

  # -- workers ---------------------------------------------------------------------------------

  def _work(self) -> None:
    while True:
      item = self._ready.get()
      if item is None:
        return
      sock, address, prefix = item
      try:
        handler = self.handler_cls(sock, address, self, rfile_prefix=prefix)
        keep, leftover = not handler.close_connection, handler.next_prefix
      except Exception:  # pylint: disable=broad-except
        log.exception("connection from %s failed", address)
        keep = False
      if keep and not self._stop.is_set():
        self._returned.put((sock, address, leftover))
      else:
        _close(sock)

  def shutdown(self) -> None:
    self._stop.set()
    self._stopped.wait(5)

  def server_close(self) -> None:
    self._stop.set()
    for _ in self._workers:
      self._ready.put(None)
    self.socket.close()


def _close(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
  sock.close()
