"""The SGLang policy server's weight-sync export: where it goes, no fsync, the room check."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple

import jax
import numpy as np
import pytest
from flax import nnx

from bat_jax import checkpointing
from bat_jax.bicurl import policy, setup
from bat_jax.model import load_pretrained
from bat_jax.run_config import RunConfig
from configs import tiny


def _config(**overrides) -> RunConfig:
  cfg = tiny.get_config("smoke")
  cfg.update_from_flattened_dict({"rollout.engine": "sglang", "rollout.sglang.launch": False,
                                  "rollout.sglang.urls": ("http://127.0.0.1:9",), **overrides})
  return RunConfig.from_config(cfg)


def test_sync_export_goes_to_export_dir_without_fsync_and_loads(tmp_path, monkeypatch):
  cfg = _config(**{"rollout.sglang.export_dir": str(tmp_path / "shm" / "weights"),
                   "rollout.sglang.export_threads": 2})
  model = setup.initial_model(cfg)
  server = policy.make_policy_server(model, cfg, tmp_path / "run", tmp_path)
  assert server.export_dir == tmp_path / "shm" / "weights"
  calls, real = [], os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
  server._export(model, server.export_dir)
  server._export(model, server.export_dir)  # a second version replaces the first whole
  assert calls == []
  checkpointing._finish_removals(server.export_dir)  # the old version's background removal
  assert sorted(p.name for p in server.export_dir.parent.iterdir()) == ["weights"]
  loaded = load_pretrained(server.export_dir)
  for got, want in zip(jax.tree.leaves(nnx.state(loaded, nnx.Param)),
                       jax.tree.leaves(nnx.state(model, nnx.Param))):
    np.testing.assert_array_equal(got, np.asarray(want).astype("bfloat16").astype(np.float32))
  server.close()
  default = policy.make_policy_server(model, _config(), tmp_path / "run", tmp_path)
  assert default.export_dir == tmp_path / "run" / "sglang_weights"
  default.close()


def test_export_dir_without_room_for_two_versions_is_refused(tmp_path, monkeypatch):
  model = setup.initial_model(_config())
  need = 2 * policy.export_bytes(model, "bfloat16")
  usage = namedtuple("usage", "total used free")
  monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(need, 0, need - 1))
  with pytest.raises(ValueError, match="rollout.sglang.export_dir .*need"):
    policy.check_export_room(tmp_path / "not" / "yet", need)
  policy.check_export_room(tmp_path, need - 1)  # enough


@pytest.mark.parametrize("field,value,why", [
    ("rollout.sglang.export_dir", "relative/dir", "absolute path"),
    ("rollout.sglang.export_threads", 0, "")])
def test_bad_export_settings_are_named(field, value, why):
  with pytest.raises(ValueError, match=f"{field}.*{why}"):
    _config(**{field: value})
