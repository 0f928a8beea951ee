"""experiments/copy_reference.py: its echo rows are what its docstring says (a copy task whose
loss covers exactly the second copy), so the jax-vs-torch curves measure copying."""

import importlib.util
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "copy_reference.py"


def _module():
  spec = importlib.util.spec_from_file_location("copy_reference", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_echo_rows_put_the_loss_on_the_second_copy_only():
  ids, mask = _module().echo_rows(6, 256, alphabet=64, seed=3)
  assert ids.shape == mask.shape == (6, 256)
  for row, m in zip(ids, mask):
    starts = np.flatnonzero(row == 0)
    assert len(starts) >= 2                         # several whole documents per row
    for s in starts:
      sep = s + 1 + np.flatnonzero(row[s + 1:] == 1)[0]
      k = sep - s - 1
      first, second = row[s + 1:sep], row[sep + 1:sep + 1 + k]
      assert 12 <= k < 40 and len(set(first.tolist())) == k     # distinct tokens
      assert np.array_equal(first, second) and row[sep + 1 + k] == 2
      assert ((3 <= first) & (first < 67)).all()                # the 64-token alphabet
      assert m[sep + 1:sep + 1 + k].all() and not m[s:sep + 1].any()
    assert m.sum() == sum(np.flatnonzero(row[s + 1:] == 1)[0] for s in starts)


def test_echo_rows_are_seeded():
  a = _module().echo_rows(2, 128, alphabet=100, seed=0)[0]
  b = _module().echo_rows(2, 128, alphabet=100, seed=0)[0]
  c = _module().echo_rows(2, 128, alphabet=100, seed=1)[0]
  assert np.array_equal(a, b) and not np.array_equal(a, c)
