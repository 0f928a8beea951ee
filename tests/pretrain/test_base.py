"""The tiny base: packed rows, a cached build keyed by its config, a leak check that fails
closed, and a resumed build that ends bit-identical."""

import concurrent.futures
import dataclasses
import itertools
import json

import jax
import numpy as np
import pytest

from bat_jax import sharding
from bat_jax.model import tokenizer as tokenizer_lib
from bat_jax.pretrain import base
from bat_jax.pretrain import probe as probe_lib
from bat_jax.pretrain.host import host_record
from base_helpers import HF, build as _build, pcfg as _pcfg

class _Checker:
  """Refuses document `bad_index`, and any text in `bad_texts` (by equality)."""

  def __init__(self, bad_index=None, bad_texts=()):
    self.bad_index, self.bad_texts, self.seen = bad_index, set(bad_texts), []

  def check_row(self, row, index=0, pool=""):
    self.seen.append(row["text"])
    assert pool == "pretrain" and isinstance(row["text"], str)
    bad = index == self.bad_index and row["text"].startswith("Facts:")  # a document
    return ["heldout_marker"] if bad or row["text"] in self.bad_texts else []


def _ensure(pcfg, tokenizer_dir, checker=None):
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
  return base.ensure_base(_build, pcfg, HF, tokenizer_dir, checker or _Checker(), mesh=mesh,
                          rules=sharding.DEFAULT_RULES)


def _targets(tokenizer, rows):
  return tokenizer.decode([t for ids, mask in rows for t, m in zip(ids, mask) if m])


def checker_texts(data):
  """The documents' texts (what a tokenizer run over the world's text would see)."""
  from bat_jax.pretrain import corpus
  return ["".join(corpus.plain_text(corpus.document(5, i))) for i in range(data.documents)]


def test_packed_rows_carry_loss_only_on_calls_and_echo_copies(tokenizer_dir, tmp_path):
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
  pcfg = _pcfg(tmp_path, echo_steps=3, echo_long_steps=2, steps=4, seq_len=96, extend_steps=2)
  data = base.build_corpus(tokenizer, pcfg, 0, _Checker())
  assert len(data.rows) == 4 * 2 and len(data.echo_rows) == 3 * 3   # steps x each phase's rows
  assert len(data.echo_long_rows) == 2 * 2 and len(data.extend_rows) == 2 * 1
  assert data.documents > 0 and data.echoes > 0 and data.long_echoes > 0
  assert data.document_redraws == data.echo_redraws == {}
  for rows, width in ((data.rows, 96), (data.echo_rows, 48), (data.echo_long_rows, 48),
                      (data.extend_rows, 256)):
    assert all(len(ids) == len(mask) == width and mask[0] == 0 for ids, mask in rows)
    assert 0.1 < np.mean([m for _, ms in rows for m in ms]) < 0.9
  runs = [tokenizer.decode([t for t, _ in group])    # each run of loss tokens: a call or a copy
           for ids, mask in data.rows
           for on, group in itertools.groupby(zip(ids, mask), key=lambda x: x[1]) if on]
  assert any(r.startswith(" python tools/") for r in runs)
  assert not any("Facts:" in r or "Usage:" in r for r in runs)
  echoed = _targets(tokenizer, data.echo_rows)
  assert "python tools/" not in echoed
  head, mid = base._separators(tokenizer)  # pylint: disable=protected-access
  assert {head, mid} <= set(tokenizer.all_special_ids)   # reserved: no text holds them
  assert not any({head, mid} & set(tokenizer(t)["input_ids"]) for t in checker_texts(data))
  lists = {"echo": [], "echo_long": [], "corpus": []}
  for phase, rows in (("echo", data.echo_rows), ("echo_long", data.echo_long_rows),
                      ("corpus", data.rows)):
    for ids, mask in rows:  # `head x1..xk mid x1..xk <eot>`, loss on `x1..xk`
      ids, mask = np.array(ids), np.array(mask)
      for start in np.flatnonzero(ids == head):
        sep = start + 1 + np.flatnonzero(ids[start + 1:] == mid)[0]
        k = sep - start - 1
        assert np.array_equal(ids[start + 1:sep], ids[sep + 1:sep + 1 + k])
        assert ids[sep + 1 + k] == 0 and mask[sep + 1:sep + 1 + k].all()
        assert not mask[start:sep + 1].any() and not mask[sep + 1 + k]
        lists[phase].append(k)
  # A short -> long curriculum of lists (base.ECHO_LENGTHS).
  for phase, (lo, hi) in base.ECHO_LENGTHS.items():
    assert lists[phase] and all(lo <= k < hi for k in lists[phase]), phase
  # The extension's rows hold the documents after the corpus phase's: none is trained twice.
  facts = lambda rows: {line for ids, _ in rows for line in tokenizer.decode(ids).split("\n")
                        if line.startswith("Facts:")}
  assert facts(data.extend_rows) and not facts(data.extend_rows) & facts(data.rows)
  again = base.build_corpus(tokenizer, pcfg, 0, _Checker())
  assert (again.rows, again.echo_rows, again.extend_rows) == \
      (data.rows, data.echo_rows, data.extend_rows)   # deterministic


def test_an_echo_the_leak_check_refuses_is_redrawn_and_rechecked_on_reuse(tokenizer_dir,
                                                                         tmp_path):
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
  eot = tokenizer.convert_tokens_to_ids(tokenizer_lib.ENDOFTEXT)
  first = base.ECHO_PHASE_START["echo"]
  refused = base._echo_text(tokenizer, 5, first, eot, 0)  # pylint: disable=protected-access
  pcfg = _pcfg(tmp_path, seq_len=128)  # any echo fits a row
  _, record = _ensure(pcfg, tokenizer_dir, _Checker(bad_texts=[refused]))
  assert record["echo_redraws"] == {str(first): 1} and record["document_redraws"] == {}
  data = base.build_corpus(tokenizer, pcfg, eot, _Checker(bad_texts=[refused]))
  assert refused not in tokenizer.decode(data.echo_rows[0][0])
  redrawn = base._echo_text(tokenizer, 5, first, eot, 1)  # pylint: disable=protected-access
  assert redrawn.split("\n")[0] in tokenizer.decode(data.echo_rows[0][0])
  checker = _Checker()
  _ensure(pcfg, tokenizer_dir, checker)  # reused: the text trained on is what is checked
  assert redrawn in checker.seen and refused not in checker.seen
  with pytest.raises(ValueError, match=f"pretraining echo {first} .*leak check"):
    _ensure(pcfg, tokenizer_dir, _Checker(bad_texts=[redrawn]))


def test_build_then_cache_hit_and_key_follows_the_config(tokenizer_dir, tmp_path):
  pcfg = _pcfg(tmp_path)
  model_dir, record = _ensure(pcfg, tokenizer_dir)
  assert not record["cache_hit"] and (record["echo_steps"], record["steps"]) == (2, 3)
  assert np.isfinite(record["echo_final_loss"]) and np.isfinite(record["corpus_final_loss"])
  # One point per phase here (2 and 3 steps < a block), at the phase's first step.
  assert record["echo_loss_curve"][0][0] == 1 and record["corpus_loss_curve"][0][0] == 1
  assert len(record["corpus_loss_curve"]) == 1 and "extend_loss_curve" not in record
  assert 0.0 <= record["copy_accuracy"] <= 1.0 and record["probes"] == 4
  assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
  assert not (model_dir.parent.with_name(model_dir.parent.name + ".build")).exists()
  assert record["host"] == host_record()   # who built it, in the record and not in the key
  checker = _Checker()
  again_dir, again = _ensure(pcfg, tokenizer_dir, checker)
  assert again_dir == model_dir and again["cache_hit"]
  assert {k: v for k, v in again.items() if k != "cache_hit"} == \
      {k: v for k, v in record.items() if k != "cache_hit"}
  assert len(checker.seen) >= record["documents"] + record["echoes"]  # checked again on reuse
  key = base.cache_key(pcfg, HF, tokenizer_dir)
  assert key == model_dir.parent.name
  assert base.cache_key(dataclasses.replace(pcfg, cache_dir="/elsewhere"), HF,
                        tokenizer_dir) == key
  assert base.cache_key(dataclasses.replace(pcfg, lr=2e-3), HF, tokenizer_dir) != key
  assert base.cache_key(pcfg, {**HF, "hidden_size": 64}, tokenizer_dir) != key


def test_loss_curve_means_each_block_from_its_first_step():
  losses = {s: float(s) for s in range(1, 61)}      # steps count from 1
  assert base.loss_curve(losses, block=25) == [[1, 13.0], [26, 38.0], [51, 55.5]]
  # A resumed phase records only its steps since the restore: its blocks keep their steps.
  assert base.loss_curve({s: 1.0 for s in range(31, 41)}, block=25) == [[26, 1.0]]


def test_concurrent_runs_on_one_cache_build_the_base_once(tokenizer_dir, tmp_path):
  """Two runs asking at once (the suite's workers, a study's seeds): one builds, the other
  waits for it and reads the cached base; they never share the staging folder."""
  pcfg = _pcfg(tmp_path, echo_steps=0)   # the corpus phase alone
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda _: _ensure(pcfg, tokenizer_dir), range(2)))
  assert sorted(r["cache_hit"] for _, r in results) == [False, True]
  assert results[0][0] == results[1][0]
  assert {k: v for k, v in results[0][1].items() if k != "cache_hit"} == \
      {k: v for k, v in results[1][1].items() if k != "cache_hit"}


def test_a_document_the_leak_check_always_refuses_is_never_trained_on(tokenizer_dir,
                                                                      tmp_path):
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
  pcfg = _pcfg(tmp_path, seq_len=256, echo_steps=0)  # any document fits a row; corpus only
  data = base.build_corpus(tokenizer, pcfg, 0, _Checker(bad_index=2))
  assert data.document_redraws == {2: -1}
  refused = {base._document_text(5, 2, a) for a in range(base.MAX_REDRAWS)}  # pylint: disable=protected-access
  trained = "".join(tokenizer.decode(ids) for ids, _ in data.rows)
  assert not any(t.split("\n")[0] in trained for t in refused)
  assert base._document_text(5, 3, 0).split("\n")[0] in trained  # pylint: disable=protected-access
  _, record = _ensure(pcfg, tokenizer_dir, _Checker(bad_index=2))
  assert record["document_redraws"] == {"2": -1}
  with pytest.raises(ValueError, match="pretraining document 3 .*leak check"):
    _ensure(pcfg, tokenizer_dir, _Checker(bad_index=3))   # reused by a run that refuses it
  assert len(list((tmp_path / "cache").glob("*/base.json"))) == 1


def test_killed_build_resumes_bit_identical(tokenizer_dir, tmp_path, monkeypatch):
  every = lambda d: _pcfg(d, echo_long_steps=2, extend_steps=2)   # finished phases restore
  whole_dir, _ = _ensure(every(tmp_path / "a"), tokenizer_dir)
  real_probe = probe_lib.probe_copy
  monkeypatch.setattr(probe_lib, "probe_copy",
                      lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
  with pytest.raises(KeyboardInterrupt):
    _ensure(every(tmp_path / "b"), tokenizer_dir)
  assert list((tmp_path / "b" / "cache").glob("*.build/ckpt_corpus"))
  assert list((tmp_path / "b" / "cache").glob("*.build/ckpt_echo"))
  assert list((tmp_path / "b" / "cache").glob("*.build/ckpt_echo_long"))
  assert list((tmp_path / "b" / "cache").glob("*.build/ckpt_extend"))
  monkeypatch.setattr(probe_lib, "probe_copy", real_probe)
  resumed_dir, record = _ensure(every(tmp_path / "b"), tokenizer_dir)
  read = lambda d: json.loads((d / "model.safetensors.index.json").read_text()) \
      if (d / "model.safetensors.index.json").is_file() else None
  from safetensors.numpy import load_file
  files = sorted(p.name for p in whole_dir.glob("*.safetensors"))
  assert files and files == sorted(p.name for p in resumed_dir.glob("*.safetensors"))
  assert read(whole_dir) == read(resumed_dir)
  for name in files:
    a, b = load_file(whole_dir / name), load_file(resumed_dir / name)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_an_echo_row_shorter_than_the_longest_echo_is_refused_by_name(tokenizer_dir, tmp_path):
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
  with pytest.raises(ValueError, match="pretrain.echo_seq_len=12 is shorter"):
    base.build_corpus(tokenizer, _pcfg(tmp_path, echo_seq_len=12), 0, _Checker())
  with pytest.raises(ValueError, match="pretrain.echo_long_seq_len=24 is shorter"):
    base.build_corpus(tokenizer, _pcfg(tmp_path, echo_long_steps=2, echo_long_seq_len=24), 0,
                      _Checker())


def test_a_tokenizer_without_the_reserved_separators_is_refused_by_name(tmp_path):
  from bat_jax.model import tokenizer_corpus
  plain = tokenizer_lib.load_tokenizer(tokenizer_lib.train_tokenizer(
      tokenizer_corpus.tiny_corpus(num_docs=40), 400, tmp_path / "tok"))
  with pytest.raises(ValueError, match="lacks the tiny base's reserved echo separators"):
    base.build_corpus(plain, _pcfg(tmp_path), 0, _Checker())


def test_a_run_whose_cells_refuse_the_cached_base_builds_its_own(tokenizer_dir, tmp_path):
  """Held-out cells are drawn per run, so a cached base can hold a string of another run's
  markers: that run never trains on it and does not crash; it builds a base of its own (the
  document drawn again), cached under a key that names its cells, and reuses it after."""
  pcfg = _pcfg(tmp_path, seq_len=256, echo_steps=0)   # corpus only: documents are refused
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.local_devices()[:1])
  ensure = lambda checker, cells: base.ensure_base(
      _build, pcfg, HF, tokenizer_dir, checker, mesh=mesh, rules=sharding.DEFAULT_RULES,
      heldout_key=cells)
  shared_dir, shared = ensure(_Checker(), "cells-a")
  assert not shared["cache_hit"] and shared_dir.parent.name == base.cache_key(pcfg, HF,
                                                                              tokenizer_dir)
  assert ensure(_Checker(), "cells-b")[1]["cache_hit"]   # no marker hit: any run reuses it
  own_dir, own = ensure(_Checker(bad_index=3), "cells-c")
  assert own_dir != shared_dir and not own["cache_hit"]
  assert own_dir.parent.name == base.cache_key(pcfg, HF, tokenizer_dir, "cells-c")
  assert own["document_redraws"] == {"3": -1} and shared["document_redraws"] == {}
  again_dir, again = ensure(_Checker(bad_index=3), "cells-c")
  assert again_dir == own_dir and again["cache_hit"]
  with pytest.raises(ValueError, match="pretraining document 4 .*leak check"):
    ensure(_Checker(bad_index=4), "cells-c")   # its own base refused too: fail closed


def test_the_echo_of_the_last_document_counted_is_checked_by_the_build(tokenizer_dir, tmp_path):
  """A phase's rows can end right after document i, so echo i is never trained on; a reuse still
  re-checks the echo of every document counted, so the build must draw (and, refused, redraw) it
  too. Before, a base whose last such echo spelled a path (`/think`) was refused by every run
  that reused it, and a run's own rebuild by that run's next reuse."""
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_dir)
  eot = tokenizer.convert_tokens_to_ids(tokenizer_lib.ENDOFTEXT)
  for steps in range(3, 40):   # a corpus whose last row ends before its last document
    pcfg = _pcfg(tmp_path, echo_steps=0, steps=steps, seq_len=256)   # every document fits
    data = base.build_corpus(tokenizer, pcfg, eot, _Checker())
    last = data.documents - 1
    trained = "".join(tokenizer.decode(ids) for ids, _ in data.rows)
    if last % base.ECHO_SHARE == 0 and base._document_text(5, last, 0).split("\n")[0] not in trained:  # pylint: disable=protected-access
      break
  else:
    pytest.fail("no corpus length tried ends right before a document with an echo")
  refused = base._echo_text(tokenizer, 5, last, eot, 0)  # pylint: disable=protected-access
  data = base.build_corpus(tokenizer, pcfg, eot, _Checker(bad_texts=[refused]))
  assert data.documents == last + 1 and data.echo_redraws == {last: 1}
  base.check_corpus(_Checker(bad_texts=[refused]), tokenizer, pcfg, data.record(), eot)
