"""Orbax checkpoints: full round trip, retention, atomic latest, errors, HF export."""

import gc
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
from jax.sharding import NamedSharding, PartitionSpec as P

from bat_jax import checkpointing, sharding
from bat_jax.checkpointing import Checkpointer, export_hf
from bat_jax.train import OptimizerConfig, init_train_state, make_optimizer, split_model
from bat_jax.model import load_pretrained

sys.path.insert(0, str(Path(__file__).parent / "grpo"))
from policy_fixtures import tiny_model  # noqa: E402

OUTER = {"round": 3, "target": "S3", "curriculum_history": [{"round": 2, "weights": [0.5, 0.5]}],
         "baseline_scores": {"S1": 0.4, "S3": None}, "promotions": ["pass", "hold"]}


def _state(seed: int):
  _, params, _ = split_model(tiny_model(seed))
  optimizer = make_optimizer(OptimizerConfig())
  state = init_train_state(params, optimizer, seed=seed)
  # Non-trivial optimizer moments, step and counters, so a mix-up would show.
  grads = jax.tree.map(lambda p: p * 0.5, params)
  _, opt_state = optimizer.update(grads, state.opt_state, params)
  return state.replace(opt_state=opt_state, step=state.step + 7, skipped=state.skipped + 2)


def test_round_trip_of_everything(tmp_path):
  state = _state(0)
  with Checkpointer(tmp_path / "ckpt", max_to_keep=2) as ckpt:
    ckpt.save(7, state, data_state={"next_index": 41}, outer_state=OUTER)
    ckpt.save(8, state, data_state=b"\x00grain-bytes\xff", outer_state=None)
  template = _state(1)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    restored = ckpt.restore(template, step=7)
    assert restored.step == 7 and restored.data_state == {"next_index": 41}
    assert restored.outer_state == OUTER
    assert jax.tree.structure(restored.state) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state)):
      np.testing.assert_array_equal(got, want)
    latest = ckpt.restore(template)
    assert latest.step == 8 and latest.data_state == b"\x00grain-bytes\xff"


def test_keeps_last_n_and_ignores_uncommitted_steps(tmp_path):
  state = _state(0)
  with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
    for step in range(1, 6):
      ckpt.save(step, state.replace(step=state.step * 0 + step))
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4, 5]
  # What a crash mid-save leaves behind: orbax's temporary directory for step 6.
  (tmp_path / "6.orbax-checkpoint-tmp-123").mkdir()
  with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
    assert ckpt.latest_step() == 5
    assert int(ckpt.restore(state).state.step) == 5
    with pytest.raises(FileNotFoundError,
                       match="no committed checkpoint step 6 under .*\\[3, 4, 5\\]"):
      ckpt.restore(state, step=6)
  with pytest.raises(FileNotFoundError, match="no committed checkpoint step None"):
    Checkpointer(tmp_path / "empty").restore(state)
  with pytest.raises(ValueError, match="max_to_keep must be >= 1"):
    Checkpointer(tmp_path / "x", max_to_keep=0)


def test_export_hf_writes_trained_params_atomically(tmp_path):
  model = tiny_model(0)
  trained = _state(3).params  # different weights than the module's own
  out = export_hf(model, tmp_path / "hf", params=trained)
  loaded = load_pretrained(out)
  _, loaded_params, _ = split_model(loaded)
  for got, want in zip(jax.tree.leaves(loaded_params), jax.tree.leaves(trained)):
    np.testing.assert_array_equal(got, want)
  # Re-export over the old directory: replaced whole, no staging leftovers.
  export_hf(model, out)
  _, params, _ = split_model(load_pretrained(out))
  _, own, _ = split_model(model)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(own)):
    np.testing.assert_array_equal(got, want)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_hf_in_bf16_for_the_rollout_server(tmp_path):
  """SGLang reads config.json's dtype (float32 would be served as float16): the rollout export
  is bf16 on disk and says so, the module keeps its fp32 params."""
  model = tiny_model(0)
  out = export_hf(model, tmp_path / "hf", dtype="bfloat16")
  config = json.loads((out / "config.json").read_text())
  assert config["dtype"] == "bfloat16"
  with safetensors.safe_open(str(out / "model.safetensors"), "np") as f:
    assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
  _, own, _ = split_model(model)
  assert {x.dtype for x in jax.tree.leaves(own)} == {np.dtype("float32")}
  _, loaded, _ = split_model(load_pretrained(out))
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(own)):
    np.testing.assert_array_equal(got, np.asarray(want).astype(jnp.bfloat16).astype(np.float32))


def test_a_save_leaves_no_device_buffer_behind_the_state(tmp_path):
  """After an 8-way sharded save, `del` of the optimizer state frees its moments: the buffers
  still live are exactly the kept params'. (Orbax keeps per-shard arrays viewing the saved
  buffers, so the plain sum of `jax.live_arrays()` counts the params 2-3 times over; it is the
  per-buffer count, `sharding.live_bytes_per_device`, that says what the devices hold.)"""
  mesh = jax.make_mesh((8,), ("fsdp",))
  split = lambda x: NamedSharding(mesh, P("fsdp") if x.ndim and x.shape[0] % 8 == 0 else P())
  state = _state(0)
  state = jax.device_put(state, jax.tree.map(split, state))
  before = {id(a) for a in jax.live_arrays()} - {id(a) for a in jax.tree.leaves(state)}
  own = lambda: [a for a in jax.live_arrays() if id(a) not in before]
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(1, state, data_state=None, outer_state=None)
  params = state.params
  del state
  gc.collect()
  kept = sum(sharding.bytes_per_device(params).values())
  assert sum(a.nbytes for a in own()) > kept  # the shard views orbax made, counted again
  assert sum(sharding.live_bytes_per_device(own()).values()) == kept  # no moment survives
  del params
  gc.collect()
  assert sum(sharding.live_bytes_per_device(own()).values()) == 0


def _fsyncs(monkeypatch) -> list:
  calls, real = [], os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
  return calls


def test_sync_export_calls_no_fsync_and_still_replaces_the_folder_whole(tmp_path, monkeypatch):
  """The per-step weight sync (`durable=False`): no fsync anywhere, staged + renamed like the
  durable export (a reader sees one whole version), loadable; evaluation exports still fsync."""
  model = tiny_model(0)
  calls = _fsyncs(monkeypatch)
  stats = {}
  out = export_hf(model, tmp_path / "hf", dtype="bfloat16", durable=False, write_threads=2,
                  max_shard_bytes=2048, stats=stats)
  export_hf(model, out, dtype="bfloat16", durable=False, params=_state(3).params)
  assert calls == [] and stats["fsync_s"] == 0 and stats["swap_s"] >= 0
  # The old version goes on a background thread; the next export of the path waits for it.
  assert {p.name for p in tmp_path.iterdir()} <= {"hf", f".hf.old-{os.getpid()}"}
  checkpointing._finish_removals(out)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging / old leftovers
  _, loaded, _ = split_model(load_pretrained(out))
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(_state(3).params)):
    np.testing.assert_array_equal(got, np.asarray(want).astype(jnp.bfloat16).astype(np.float32))
  export_hf(model, tmp_path / "eval")  # durable by default
  files = [p for p in (tmp_path / "eval").iterdir() if p.is_file()]
  assert len(calls) >= 2 * len(files)  # each file as written, and the tree before the swap
