"""Reads a published round back through grain, one batch at a time, with resumable state.

The reader verifies every shard's sha256 against the manifest before it yields anything, so a
corrupted round is refused (ShardDigestError naming the shard) and nothing trains on it. Batch `b`
is rebuilt from the round's composition: rows `[b*k_p, (b+1)*k_p)` of each pool `p`, in pool order
(s_target, s_mix, e2e). Its iterator state is a small JSON-able dict: the checkpointing code
stores it, and `set_state` continues exactly where the saved iterator stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import grain

from bat_jax import workflow
from bat_jax.stagebank import shards

Batch = list[dict[str, Any]]


def _layout_fields(round_dir: Path, manifest: dict[str, Any]) -> tuple[dict[str, int], int]:
  """(batch composition, n_batches) of a verified manifest, each a non-negative int."""
  try:
    composition = {p: manifest["batch_composition"][p] for p in workflow.POOLS}
    n_batches = manifest["config"]["n_batches"]
  except (KeyError, TypeError) as e:
    raise shards.RoundFormatError(f"{round_dir / shards.MANIFEST}: field {e} is missing "
                                  "(batch_composition per pool, config.n_batches)") from None
  for name, value in [*composition.items(), ("n_batches", n_batches)]:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise shards.RoundFormatError(f"{round_dir / shards.MANIFEST}: {name} {value!r} is not a "
                                    "non-negative integer")
  return composition, n_batches


class RoundReader:
  """Iterates a round's batches (lists of row dicts) in deterministic order.

  Args:
    round_dir: a published round directory.
    shard_index: this data-parallel reader's index (batches `shard_index::shard_count`).
    shard_count: number of data-parallel readers.
    num_epochs: passes over the round.
    shuffle_seed: when set, the batch order is a seeded permutation (the same every epoch);
      batch contents never change.
  """

  def __init__(self, round_dir: Path, *, shard_index: int = 0, shard_count: int = 1,
               num_epochs: int = 1, shuffle_seed: int | None = None):
    if not 0 <= shard_index < shard_count:
      raise ValueError(f"shard_index {shard_index} must be in [0, shard_count={shard_count})")
    if num_epochs < 1:
      raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
    self.round_dir = Path(round_dir)
    self.manifest = shards.verify_round(self.round_dir)
    self.manifest_sha256 = shards.manifest_digest(self.round_dir)
    self.composition, self.n_batches = _layout_fields(self.round_dir, self.manifest)
    self._sources = {
        pool: grain.sources.ArrayRecordDataSource([str(self.round_dir / shard["file"])])
        for pool, shard in self.manifest["shards"].items() if shard["rows"] > 0}
    for pool, k in self.composition.items():
      have = len(self._sources[pool]) if pool in self._sources else 0
      if have != k * self.n_batches:
        raise shards.ShardDigestError(
            f"shard of pool {pool} in {self.round_dir} has {have} rows, composition needs "
            f"{k * self.n_batches}")
    self._layout = dict(shard_index=shard_index, shard_count=shard_count, num_epochs=num_epochs,
                        shuffle_seed=shuffle_seed)
    dataset = grain.MapDataset.range(self.n_batches)
    if shuffle_seed is not None:
      dataset = dataset.shuffle(seed=shuffle_seed)
    dataset = dataset[shard_index::shard_count]
    if num_epochs > 1:
      dataset = dataset.repeat(num_epochs)
    self._dataset = dataset.map(self.batch).to_iter_dataset()
    self._iterator = iter(self._dataset)

  def batch(self, b: int) -> Batch:
    """Rows of batch `b` in composition order (random access, no iterator state)."""
    b = int(b)
    if not 0 <= b < self.n_batches:
      raise IndexError(f"batch {b} out of range [0, {self.n_batches})")
    rows = []
    for pool in workflow.POOLS:
      k = self.composition[pool]
      rows.extend(shards.decode_row(self._sources[pool][b * k + j],
                                    f"{self.round_dir} pool {pool} record {b * k + j}")
                  for j in range(k))
    return rows

  def __len__(self) -> int:
    """Batches this reader yields over all epochs."""
    sc, si = self._layout["shard_count"], self._layout["shard_index"]
    return len(range(si, self.n_batches, sc)) * self._layout["num_epochs"]

  def __iter__(self) -> Iterator[Batch]:
    return self

  def __next__(self) -> Batch:
    return next(self._iterator)

  def get_state(self) -> dict[str, Any]:
    """A JSON-able snapshot: which round, how it is read, and where the iterator is."""
    return {"round": self.manifest["round"], "manifest_sha256": self.manifest_sha256,
            **self._layout, "iterator": self._iterator.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores `get_state()` output; refuses a state taken on another round or layout."""
    if state.get("manifest_sha256") != self.manifest_sha256:
      raise ValueError(f"reader state is for manifest {state.get('manifest_sha256')!r}, not "
                       f"{self.manifest_sha256} of {self.round_dir}")
    for key, value in self._layout.items():
      if state.get(key) != value:
        raise ValueError(f"reader state field {key!r} is {state.get(key)!r}, reader has {value!r}")
    self._iterator.set_state(state["iterator"])
