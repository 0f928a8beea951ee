"""experiments/echo_transfer.py: its evaluation rows are what its docstring says, so a score on
them measures copying at that length and depth."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "echo_transfer.py"
HEAD, MID, EOT = 0, 1, 2


def _module():
  spec = importlib.util.spec_from_file_location("echo_transfer", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _echoes():
  return _module().Echoes(HEAD, MID, EOT, np.arange(3, 203))


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


def test_pair_rows_score_each_value_after_its_own_key_in_a_new_order():
  orders = 0
  for ids, mask in _echoes().rows(8, 256, 12, 41, seed=3, pairs=True):
    ids, mask = np.asarray(ids), np.asarray(mask)
    for start in np.flatnonzero(ids == HEAD):
      mid = start + 1 + np.flatnonzero(ids[start + 1:] == MID)[0]
      first = ids[start + 1:mid].reshape(-1, 2)
      second = ids[mid + 1:mid + 1 + first.size].reshape(-1, 2)
      assert {tuple(p) for p in first} == {tuple(p) for p in second}   # the same pairs
      orders += not np.array_equal(first, second)
      # Loss on the second half's values only: never on a key, never on the first half.
      assert mask[start:mid + 1].sum() == 0
      assert mask[mid + 1:mid + 1 + first.size].tolist() == [0, 1] * len(first)
  assert orders > 0


def test_a_phase_names_its_kind_or_is_refused():
  module = _module()
  assert module.parse_phase("32x64:8-27:300:pairs") == (32, 64, 8, 27, 300, True)
  assert module.parse_phase("64x32:2-7:100") == (64, 32, 2, 7, 100, False)
  with pytest.raises(ValueError, match="fourth field"):
    module.parse_phase("64x32:2-7:100:pair")
  with pytest.raises(ValueError, match="not a permutation"):
    module.pair_echo_document([5, 6, 7, 8], [0, 0], HEAD, MID, EOT)
