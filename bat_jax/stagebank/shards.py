"""Round shards on disk: one ArrayRecord file per pool plus `manifest.json`, published atomically.

Layout of a bank directory:

    BANK/
      round_000003/            a published round (appears only complete, by rename)
        s_target.array_record  rows as canonical JSON (sorted keys, compact, UTF-8)
        s_mix.array_record
        e2e.array_record
        manifest.json          schema version, counts, sha256 per shard, config, weights, receipt
      .tmp-round_000003-*/     a round being written (never read)

Rows are encoded canonically and ArrayRecord is written with fixed options, so the same round
spec gives byte-identical shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from array_record.python import array_record_module

from bat_jax import io_utils

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SHARD_SUFFIX = ".array_record"
_WRITER_OPTIONS = "group_size:1"  # one record per chunk: O(1) random access for grain
_ROUND_RE = re.compile(r"^round_(\d{6})$")


class ShardDigestError(RuntimeError):
  """A shard's sha256 does not match its manifest: nothing may train on the round."""


class RoundExistsError(RuntimeError):
  """A different round was already published under the same round index."""


def round_dirname(round_index: int) -> str:
  return f"round_{round_index:06d}"


def published_rounds(bank: Path) -> list[int]:
  """Round indices published in `bank` (complete by construction), ascending."""
  if not Path(bank).is_dir():
    return []
  found = (_ROUND_RE.match(p.name) for p in Path(bank).iterdir())
  return sorted(int(m.group(1)) for m in found if m)


def encode_row(row: Any) -> bytes:
  """Canonical JSON bytes of a row (the same row always gives the same bytes)."""
  return json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                    allow_nan=False).encode("utf-8")


def decode_row(record: bytes) -> Any:
  return json.loads(record.decode("utf-8"))


def sha256_file(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def write_shard(path: Path, rows: Sequence[Any]) -> int:
  """Writes rows to one ArrayRecord file and fsyncs it; returns the row count."""
  writer = array_record_module.ArrayRecordWriter(str(path), _WRITER_OPTIONS)
  try:
    for row in rows:
      writer.write(encode_row(row))
  finally:
    writer.close()
  io_utils.fsync_file(path)
  return len(rows)


def publish_dir(final: Path, pools: Mapping[str, Sequence[Any]],
                manifest_fields: Mapping[str, Any]) -> Path:
  """Writes shards (one per pool) + manifest into a temp dir beside `final`, fsyncs, renames.

  Args:
    final: the directory to publish (its parent is created if needed).
    pools: pool name -> rows, in order.
    manifest_fields: extra manifest content (config, weights, composition, leak receipt).

  Returns:
    `final`.

  Raises:
    RoundExistsError: `final` is already published with a different manifest. Publishing the
      identical content again is a no-op (a restarted server may rebuild it).
  """
  final = Path(final)
  final.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
  try:
    shards = {}
    for pool, rows in pools.items():
      name = pool + SHARD_SUFFIX
      count = write_shard(tmp / name, rows)
      shards[pool] = {"file": name, "rows": count, "sha256": sha256_file(tmp / name)}
    manifest = {"schema_version": SCHEMA_VERSION, "shards": shards,
                "total_rows": sum(s["rows"] for s in shards.values()), **manifest_fields}
    (tmp / MANIFEST).write_bytes(json.dumps(manifest, sort_keys=True, indent=1).encode())
    io_utils.fsync_file(tmp / MANIFEST)
    io_utils.fsync_dir(tmp)
    if final.exists():
      if load_manifest(final) != manifest:
        raise RoundExistsError(f"{final} is already published with a different manifest")
      shutil.rmtree(tmp)
      return final
    os.rename(tmp, final)  # atomic: readers see nothing or the complete directory
    io_utils.fsync_dir(final.parent)
    return final
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def publish_round(bank: Path, round_index: int, pools: Mapping[str, Sequence[Any]],
                  manifest_fields: Mapping[str, Any]) -> Path:
  """Publishes a round as `BANK/round_NNNNNN/` (see `publish_dir`)."""
  return publish_dir(Path(bank) / round_dirname(round_index), pools,
                     {"round": round_index, **manifest_fields})


def load_manifest(round_dir: Path) -> dict[str, Any]:
  """Reads a round's manifest (no digest check; see `verify_round`)."""
  path = Path(round_dir) / MANIFEST
  if not path.is_file():
    raise FileNotFoundError(f"no {MANIFEST} in {round_dir}: not a published round")
  manifest = json.loads(path.read_text())
  if manifest.get("schema_version") != SCHEMA_VERSION:
    raise ValueError(f"{path}: schema_version {manifest.get('schema_version')!r} is not "
                     f"{SCHEMA_VERSION}")
  return manifest


def manifest_digest(round_dir: Path) -> str:
  return sha256_file(Path(round_dir) / MANIFEST)


def read_rows(round_dir: Path, pool: str) -> list[Any]:
  """All rows of one verified pool shard, in order (small sets such as SFT rows)."""
  manifest = verify_round(round_dir)
  if pool not in manifest["shards"]:
    raise KeyError(f"{round_dir} has no pool {pool!r}; it has {sorted(manifest['shards'])}")
  path = Path(round_dir) / manifest["shards"][pool]["file"]
  reader = array_record_module.ArrayRecordReader(str(path))
  try:
    return [decode_row(r) for r in reader.read_all()]
  finally:
    reader.close()


def verify_round(round_dir: Path) -> dict[str, Any]:
  """Checks every shard against the manifest's sha256 and the leak receipt; returns the manifest.

  Raises:
    ShardDigestError: naming the first shard that is missing or whose digest does not match, or
      a round whose leak receipt did not pass.
  """
  round_dir = Path(round_dir)
  manifest = load_manifest(round_dir)
  receipt = manifest.get("leak_receipt")
  if not isinstance(receipt, Mapping) or receipt.get("passed") is not True:
    raise ShardDigestError(f"{round_dir / MANIFEST}: leak receipt missing or not passed")
  for pool, shard in manifest["shards"].items():
    path = round_dir / shard["file"]
    if not path.is_file():
      raise ShardDigestError(f"shard {path} (pool {pool}) is missing")
    actual = sha256_file(path)
    if actual != shard["sha256"]:
      raise ShardDigestError(f"shard {path} (pool {pool}) has sha256 {actual}, manifest says "
                             f"{shard['sha256']}: refusing to read this round")
  return manifest
