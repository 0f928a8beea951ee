"""experiments/echo_transfer.py: its evaluation rows are what its docstring says, so a score on
them measures copying at that length and depth."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "echo_transfer.py"
HEAD, MID, EOT = 0, 1, 2


def _echoes():
  spec = importlib.util.spec_from_file_location("echo_transfer", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.Echoes(HEAD, MID, EOT, np.arange(3, 203))


def _documents(ids):
  """`(first copy, second copy, start of the second)` of every echo in `ids`."""
  out = []
  for start in np.flatnonzero(ids == HEAD):
    mid = start + 1 + np.flatnonzero(ids[start + 1:] == MID)[0]
    k = mid - start - 1
    out.append((ids[start + 1:mid], ids[mid + 1:mid + 1 + k], mid + 1))
  return out


def test_packed_rows_score_every_second_copy_and_nothing_else():
  for ids, mask in _echoes().rows(4, 256, 12, 41, seed=1):
    ids, mask = np.asarray(ids), np.asarray(mask)
    docs = _documents(ids)
    assert len(ids) == 256 and len(docs) >= 2
    expected = np.zeros(256, int)
    for first, second, at in docs:
      assert 12 <= len(first) < 41 and np.array_equal(first, second)
      expected[at:at + len(first)] = 1
    assert np.array_equal(mask, expected)


@pytest.mark.parametrize("shared", [False, True])
def test_deep_rows_score_one_list_after_the_others(shared):
  echoes = _echoes()
  rows = echoes.deep_rows(6, 1024, 12, 41, seed=2, shared=shared)
  overlaps = []
  for ids, mask in rows:
    ids, mask = np.asarray(ids), np.asarray(mask)
    docs = _documents(ids)
    *fillers, (last, _, at) = docs
    assert len(ids) == 1024 and len(fillers) >= 10
    # Padded only by less than one more list (<= 2 * 40 + 3 tokens): the scored list is deep.
    assert 0 <= 1024 - (at + len(last) + 1) < 2 * 40 + 3
    assert mask.sum() == len(last) and mask[at:at + len(last)].all()   # the last list only
    assert set(last.tolist()) <= set(echoes.pool[0::2].tolist())
    filler = set(np.concatenate([f for f, _, _ in fillers]).tolist())
    overlaps.append(len(filler & set(last.tolist())))
  # The other half of the pool, or the whole pool: shared pieces make look-back ambiguous.
  assert (max(overlaps) > 0) if shared else (max(overlaps) == 0)
