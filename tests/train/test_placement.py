"""Multi-host placement (`bat_jax.train.placement`) through the real Trainer: two processes under
jax.distributed (gloo CPU collectives) place host params and SFT batches onto an fsdp mesh that
spans both, train two steps, save and restore orbax, and build a global batch from per-process
rows; the result must equal the same two steps in this one process."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from bat_jax import sharding
from bat_jax.sft import sft_dataset
from bat_jax.train import placement
from drive_placement import TWO_STEPS, sft_setup

DRIVER = Path(__file__).with_name("drive_placement.py")
ROOT = Path(__file__).resolve().parents[2]


def test_place_keeps_placed_leaves_and_single_process_helpers_are_identities():
  mesh = sharding.make_mesh(data=1, fsdp=8, tensor=1)
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  placed = placement.place({"w": np.arange(16.0)}, {"w": spec})
  assert placed["w"].sharding == spec and len(placed["w"].sharding.device_set) == 8
  assert placement.place(placed, {"w": spec})["w"] is placed["w"]
  rows = {"x": np.ones((2, 3))}
  assert placement.global_batch(rows, {"x": spec})["x"] is rows["x"]
  assert sharding.host_local(placed) is placed


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # two JAX processes compiling a step: over a minute on a loaded box
def test_two_processes_place_train_checkpoint_like_one(tmp_path):
  env = {**os.environ, "PYTHONPATH": str(ROOT),
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, str(DRIVER), str(tmp_path), str(pid), str(port)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for pid in (0, 1)]
  outputs = [p.communicate(timeout=900)[0].decode(errors="replace") for p in procs]
  for pid, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0 and f"process {pid} done" in out, out[-4000:]
  got = np.load(tmp_path / "result.npz")
  np.testing.assert_array_equal(got["gathered"], [[0] * 3] * 2 + [[1] * 3] * 2)

  model, examples, make = sft_setup()  # the same two steps on one device of this process
  trainer = make(model, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
  state = trainer.init_state(trainer.place(nnx.state(model, nnx.Param)))
  batches = iter(sft_dataset(examples, **TWO_STEPS))
  for _ in range(2):
    state, metrics = trainer.step(state, trainer.place_batch(next(batches)))
  np.testing.assert_allclose(got["loss"], float(metrics["loss"]), rtol=1e-5)
  for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
    np.testing.assert_allclose(got[jax.tree_util.keystr(path)], np.asarray(leaf), rtol=1e-4,
                               atol=1e-6, err_msg=jax.tree_util.keystr(path))
