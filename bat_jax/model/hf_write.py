"""The write half of the HF export: sharded params -> host arrays in HF layout -> safetensors.

Each param goes from its shards straight into its HF layout on the host, one pass per shard: the
cast to the storage dtype and, for kernels, the transpose to torch's [out, in] are one copy
(`fetch_hf_layout`). Files are written by a small safetensors serialiser straight from those
arrays (`write_safetensors`: the format's 8-byte header length, JSON header, raw buffers), so no
`tobytes` copy of each file is made either.

`durable=False` skips every fsync: right for the per-step rollout sync, which a crash simply
redoes; evaluation exports and the final model stay durable.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import struct
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import jax
import ml_dtypes
import numpy as np

from bat_jax import io_utils, sharding

# safetensors dtype codes (the format's spec) of the numpy dtypes an export can hold.
_CODES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64",
          np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.int8): "I8",
          np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
# A kernel is transposed in tiles of this many source rows: ~3x faster than one strided copy of
# the whole shard on this box (the tile's rows stay in cache).
_TILE_ROWS = 64
_WRITE_CHUNK = 256 * 2**20  # one write call never exceeds Linux's ~2 GiB per-call limit


def _cast_transposed(dst: np.ndarray, src: np.ndarray) -> None:
  """`dst[...] = swapaxes(src, -1, -2)` cast to dst's dtype, in tiles of src rows."""
  for i in range(0, src.shape[-2], _TILE_ROWS):
    np.copyto(dst[..., i:i + _TILE_ROWS], np.swapaxes(src[..., i:i + _TILE_ROWS, :], -1, -2),
              casting="unsafe")


def fetch_hf_layout(value: jax.Array, dtype, *, transpose: bool = False,
                    threads: int = 1) -> np.ndarray:
  """One param on this host in `dtype`, its last two axes swapped when `transpose` (a kernel in
  torch's [out, in]); each of this process's shards is cast (and transposed) straight into its
  place, `threads` shards at once (numpy's casts release the GIL): no device-side cast, no
  gather onto one device, no intermediate copy. A leaf spanning processes is first spread over
  each host's own devices (`sharding.host_local`, a collective every process joins)."""
  if not value.is_fully_addressable:
    value = sharding.host_local(value)
  shape = tuple(value.shape)
  if transpose:
    shape = shape[:-2] + (shape[-1], shape[-2])
  out = np.empty(shape, np.dtype(dtype or value.dtype))

  def put(shard) -> None:
    data, index = np.asarray(shard.data), tuple(shard.index)
    if transpose:
      _cast_transposed(out[index[:-2] + (index[-1], index[-2])], data)
    else:
      np.copyto(out[index], data, casting="unsafe")

  shards = [s for s in value.addressable_shards if s.replica_id == 0]  # each slice once
  if threads > 1 and len(shards) > 1:
    list(_pool(threads).map(put, shards))
  else:
    for shard in shards:
      put(shard)
  return out


@functools.lru_cache(maxsize=None)
def _pool(threads: int) -> ThreadPoolExecutor:
  return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hf-fetch")


def safetensors_header(tensors: Mapping[str, np.ndarray],
                       metadata: Optional[Mapping[str, str]] = None) -> bytes:
  """The header of a safetensors file holding `tensors` in their order: little-endian u64
  length, then the JSON (name -> dtype, shape, data_offsets), space-padded to 8 bytes."""
  header: dict = {"__metadata__": dict(metadata)} if metadata else {}
  offset = 0
  for name, t in tensors.items():
    if t.dtype not in _CODES:
      raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which safetensors export does not "
                       f"support (supported: {sorted(str(d) for d in _CODES)})")
    header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape),
                    "data_offsets": [offset, offset + t.nbytes]}
    offset += t.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)
  return struct.pack("<Q", len(raw)) + raw


def write_safetensors(dest: Path, tensors: Mapping[str, np.ndarray], *, durable: bool = True,
                      metadata: Optional[Mapping[str, str]] = None,
                      stats: Optional[dict] = None) -> int:
  """Writes `tensors` as one safetensors file at `dest`; returns the bytes written.

  The file is written beside `dest` and renamed into place (a reader sees the old file or the
  whole new one); `durable` also fsyncs it before and its folder after the rename. Tensors go in
  by descending item size, then name, so every tensor starts aligned to its own item size (as
  safetensors' own writer does). `stats` (optional) accumulates write_s / fsync_s / bytes_written.
  """
  dest = Path(dest)
  order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
  arrays = {n: np.ascontiguousarray(tensors[n]) for n in order}
  head = safetensors_header(arrays, metadata)
  tmp = dest.with_name(f".{dest.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
  t0 = time.perf_counter()
  t_sync = 0.0
  try:
    with open(tmp, "xb") as f:
      f.write(head)
      for a in arrays.values():
        flat = a.reshape(-1).view(np.uint8)  # the buffer itself, no copy
        for i in range(0, flat.size, _WRITE_CHUNK):
          f.write(flat[i:i + _WRITE_CHUNK])
      if durable:
        f.flush()
        s = time.perf_counter()
        os.fsync(f.fileno())
        t_sync += time.perf_counter() - s
    os.replace(tmp, dest)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  if durable:
    s = time.perf_counter()
    io_utils.fsync_dir(dest.parent)
    t_sync += time.perf_counter() - s
  nbytes = len(head) + sum(a.nbytes for a in arrays.values())
  if stats is not None:
    add_stats(stats, write_s=time.perf_counter() - t0 - t_sync, fsync_s=t_sync,
              bytes_written=nbytes)
  return nbytes


_STATS_LOCK = threading.Lock()  # writer threads add into one dict


def add_stats(stats: Optional[dict], **values: float) -> None:
  """Adds `values` into the `stats` dict (no-op for None)."""
  if stats is not None:
    with _STATS_LOCK:
      for key, v in values.items():
        stats[key] = stats.get(key, 0) + v
