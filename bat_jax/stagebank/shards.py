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
from typing import Any, Iterable, Mapping, Sequence

from array_record.python import array_record_module

from bat_jax import io_utils

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SHARD_SUFFIX = ".array_record"
_WRITER_OPTIONS = "group_size:1"  # one record per chunk: O(1) random access for grain
_ROUND_RE = re.compile(r"^round_(\d{6})$")


class ShardDigestError(RuntimeError):
  """A shard's sha256 does not match its manifest: nothing may train on the round."""


class RoundFormatError(ShardDigestError, ValueError):
  """A manifest or shard is malformed (bad JSON, missing field, truncated file, bad record)."""


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


def decode_row(record: bytes, where: str = "record") -> Any:
  """A row from its canonical JSON bytes; `where` (file and record index) names a bad one."""
  try:
    return json.loads(record.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise RoundFormatError(f"{where} is not a UTF-8 JSON row: {e}") from None


def rows_digest(records: Iterable[bytes]) -> str:
  """sha256 over length-prefixed records: what a leak receipt holds per pool, rechecked at read
  time against the shard's records (a receipt is checked against the files, never believed)."""
  h = hashlib.sha256()
  for record in records:
    h.update(len(record).to_bytes(8, "big"))
    h.update(record)
  return h.hexdigest()


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
  """Reads and validates a round's manifest (no digest check; see `verify_round`).

  Raises:
    FileNotFoundError: no manifest.
    RoundFormatError: naming the manifest and the field when it is not valid JSON, lacks a field
      or a shard entry is malformed (a file name that is not a plain name inside the round).
  """
  path = Path(round_dir) / MANIFEST
  if path.is_symlink() or not path.is_file():
    raise FileNotFoundError(f"no {MANIFEST} in {round_dir}: not a published round")
  try:
    manifest = json.loads(path.read_bytes())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise RoundFormatError(f"{path} is not valid JSON: {e}") from None
  if not isinstance(manifest, dict):
    raise RoundFormatError(f"{path} is not a JSON object")
  if manifest.get("schema_version") != SCHEMA_VERSION:
    raise RoundFormatError(f"{path}: schema_version {manifest.get('schema_version')!r} is not "
                           f"{SCHEMA_VERSION}")
  shards = manifest.get("shards")
  if not isinstance(shards, dict) or not shards:
    raise RoundFormatError(f"{path}: field 'shards' is missing or not a non-empty object")
  for pool, shard in shards.items():
    _check_shard_entry(path, pool, shard)
  total = manifest.get("total_rows")
  if total != sum(s["rows"] for s in shards.values()):
    raise RoundFormatError(f"{path}: field 'total_rows' {total!r} is not the sum of the shard "
                           "row counts")
  _check_round_identity(Path(round_dir), path, manifest)
  return manifest


def _check_round_identity(round_dir: Path, path: Path, manifest: Mapping[str, Any]) -> None:
  """A `round_NNNNNN` folder must hold round NNNNNN's manifest: a round copied or moved under
  another index would otherwise train (and resume) on the wrong curriculum weights."""
  found = _ROUND_RE.match(round_dir.name)
  if found is None:
    return  # not a round folder (the SFT rows' folder)
  want = int(found.group(1))
  config = manifest.get("config")
  named = {"round": manifest.get("round"),
           "config.round": config.get("round") if isinstance(config, Mapping) else want}
  for field, got in named.items():
    if isinstance(got, bool) or got != want:
      raise RoundFormatError(f"{path}: field {field!r} names round {got!r}, but the folder "
                             f"{round_dir.name} is round {want}: refusing a manifest of another "
                             "round")


def _check_shard_entry(path: Path, pool: str, shard: Any) -> None:
  where = f"{path}: shards.{pool}"
  if not isinstance(shard, dict):
    raise RoundFormatError(f"{where} is not an object")
  name = shard.get("file")
  if (not isinstance(name, str) or name != Path(name).name or name in ("", ".", "..")
      or name.startswith(".") or not name.endswith(SHARD_SUFFIX)):
    raise RoundFormatError(f"{where}.file {name!r} is not a plain *{SHARD_SUFFIX} file name "
                           "inside the round directory")
  rows = shard.get("rows")
  if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
    raise RoundFormatError(f"{where}.rows {rows!r} is not a non-negative integer")
  digest = shard.get("sha256")
  if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
    raise RoundFormatError(f"{where}.sha256 {digest!r} is not a sha256 hex digest")


_EMPTY_ROWS_DIGEST = rows_digest(())


def manifest_digest(round_dir: Path) -> str:
  return sha256_file(Path(round_dir) / MANIFEST)


def read_records(path: Path, expected_rows: int) -> list[bytes]:
  """All records of one shard file; a truncated or foreign file, or another record count than
  the manifest's, is a RoundFormatError naming the file."""
  try:
    reader = array_record_module.ArrayRecordReader(str(path))
    try:
      count = reader.num_records()
      records = reader.read_all() if count else []
    finally:
      reader.close()
  except (RuntimeError, OSError, ValueError) as e:
    raise RoundFormatError(f"shard {path} is not a readable ArrayRecord file (truncated or "
                           f"corrupt): {e or type(e).__name__}") from None
  if count != expected_rows or len(records) != expected_rows:
    raise RoundFormatError(f"shard {path} holds {count} records, its manifest says "
                           f"{expected_rows}")
  return list(records)


def read_rows(round_dir: Path, pool: str) -> list[Any]:
  """All rows of one verified pool shard, in order (small sets such as SFT rows)."""
  manifest = verify_round(round_dir)
  if pool not in manifest["shards"]:
    raise KeyError(f"{round_dir} has no pool {pool!r}; it has {sorted(manifest['shards'])}")
  shard = manifest["shards"][pool]
  path = Path(round_dir) / shard["file"]
  return [decode_row(r, f"shard {path} record {i}")
          for i, r in enumerate(read_records(path, shard["rows"]))]


def _check_receipt(round_dir: Path, manifest: Mapping[str, Any]) -> Mapping[str, str]:
  """The receipt's per-pool row digests, after checking it passed and covers every row."""
  receipt = manifest.get("leak_receipt")
  where = round_dir / MANIFEST
  if not isinstance(receipt, Mapping) or receipt.get("passed") is not True:
    raise ShardDigestError(f"{where}: leak receipt missing or not passed")
  if receipt.get("rows_checked") != manifest["total_rows"]:
    raise ShardDigestError(f"{where}: leak receipt checked {receipt.get('rows_checked')!r} rows, "
                           f"the round has {manifest['total_rows']}")
  digests = receipt.get("rows_sha256")
  if not isinstance(digests, Mapping) or not set(digests) <= set(manifest["shards"]):
    raise ShardDigestError(f"{where}: leak receipt has no row digest per pool (rows_sha256): it "
                           "cannot be checked against the shards; rebuild the round")
  return digests


def verify_round(round_dir: Path) -> dict[str, Any]:
  """Checks every shard against the manifest and the leak receipt; returns the manifest.

  Each shard must be a regular file (not a link) whose sha256 matches the manifest, whose record
  count matches, whose records are UTF-8 JSON, and whose records hash to the digest the leak
  receipt recorded for the rows it checked (a shard rewritten after publication with its manifest
  digest fixed up is refused).

  Raises:
    ShardDigestError / RoundFormatError: naming the manifest or shard at fault.
  """
  round_dir = Path(round_dir)
  manifest = load_manifest(round_dir)
  receipt_digests = _check_receipt(round_dir, manifest)
  for pool, shard in manifest["shards"].items():
    path = round_dir / shard["file"]
    if path.is_symlink() or not path.is_file():
      raise ShardDigestError(f"shard {path} (pool {pool}) is missing or not a regular file")
    actual = sha256_file(path)
    if actual != shard["sha256"]:
      raise ShardDigestError(f"shard {path} (pool {pool}) has sha256 {actual}, manifest says "
                             f"{shard['sha256']}: refusing to read this round")
    records = read_records(path, shard["rows"])
    if rows_digest(records) != receipt_digests.get(pool, _EMPTY_ROWS_DIGEST):
      raise ShardDigestError(f"shard {path} (pool {pool}) holds other rows than the leak "
                             "pre-check passed (receipt rows_sha256 differs): refusing it")
    for i, record in enumerate(records):
      decode_row(record, f"shard {path} record {i}")
  return manifest
