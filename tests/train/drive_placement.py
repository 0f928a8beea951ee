"""One process of the two-process placement check (a subprocess target for test_placement.py).

argv: OUT_DIR PROCESS_ID PORT. Under jax.distributed (gloo CPU collectives, 2 devices per
process) it places a tiny model's host params and SFT batches onto an fsdp mesh spanning both
processes through the real `Trainer`, takes two steps, saves and restores an orbax checkpoint,
and assembles a global batch from per-process rows. Process 0 writes what the test compares.
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "grpo")]

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

import launch  # noqa: E402

TWO_STEPS = dict(batch_size=4, max_len=16, seed=0)  # sft_dataset options of both runs


def sft_setup():
  """`(tiny model, SFT examples, mesh -> Trainer)`: the same on every process and in the test."""
  from bat_jax import sharding  # imported after jax.distributed
  from bat_jax.sft import sft_loss_fn
  from bat_jax.train import OptimizerConfig, Trainer, TrainerConfig
  from policy_fixtures import sft_examples, tiny_model
  model = tiny_model()
  cfg = TrainerConfig(optimizer=OptimizerConfig(learning_rate=1e-2))
  make = lambda m, mesh: Trainer.for_model(m, sft_loss_fn(), cfg, mesh, sharding.DEFAULT_RULES)
  return model, sft_examples(), make


def main(out: pathlib.Path, pid: int, port: int) -> None:
  launch.initialize_distributed(ml_collections.ConfigDict(
      {"coordinator_address": f"127.0.0.1:{port}", "num_processes": 2, "process_id": pid}))
  import jax
  from flax import nnx
  from bat_jax import sharding
  from bat_jax.checkpointing import Checkpointer
  from bat_jax.sft import sft_dataset
  from bat_jax.train import placement

  model, examples, trainer_of = sft_setup()
  trainer = trainer_of(model, sharding.make_mesh(data=1, fsdp=4, tensor=1))
  host = nnx.state(model, nnx.Param)
  params = trainer.place(host)
  assert not all(x.is_fully_addressable for x in jax.tree.leaves(params))  # spans processes
  again = trainer.place(params)  # already placed: kept, never fetched
  assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)))
  state = trainer.init_state(params)
  batches = iter(sft_dataset(examples, **TWO_STEPS))
  for _ in range(2):
    state, metrics = trainer.step(state, trainer.place_batch(next(batches)))
  with Checkpointer(out / "ckpt") as ckpt:
    ckpt.save(2, state)
    ckpt.wait()
    restored = ckpt.restore(trainer.state_target()).state
  final = sharding.host_local(state.params)
  back = sharding.host_local(restored.params)
  big = max(jax.tree.leaves(final), key=lambda x: x.size)
  # This process's own copy, split over its 2 local devices: never whole on one device.
  assert big.is_fully_addressable and len(big.sharding.device_set) == 2, big.sharding
  assert {s.data.size for s in big.addressable_shards} == {big.size // 2}
  for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rows = np.full((2, 3), pid, np.int32)  # this process's own rows
  glob = placement.global_batch({"x": rows}, {"x": sharding.batch_sharding(trainer.mesh, 2)})
  gathered = np.asarray(sharding.host_local(glob)["x"])
  if pid == 0:
    flat = {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(final)}
    np.savez(out / "result.npz", loss=float(metrics["loss"]), gathered=gathered, **flat)
  print(f"process {pid} done", flush=True)


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
