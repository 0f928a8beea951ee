"""Per-step weight sync to the rollout server: bytes moved and seconds per phase, old vs new.

A 9B-width Qwen3.5 text model at reduced depth (hidden 4096, the 9B's head dims and MLP width,
`--layers` layers of the 9B's DeltaNet/attention pattern, vocab `--vocab`), fp32 master params
FSDP-sharded over 8 fake CPU devices with `configs/bat9b.py`'s mesh and sharding rules. Each
repeat (alternating) exports it for SGLang in bf16 three ways:

- `old`: the export as it was before issue 25's weight-sync change (a copy of that code below):
  per leaf a host buffer filled by an astype copy of each shard, a second copy to transpose each
  kernel, safetensors' `save_file` (a `tobytes` copy of each file, then the write), fsync of
  every file and folder, then fsync of the tree, rename swap, removal of the old version. To
  `--disk-dir` (the run's workdir today).
- `new-disk`: `bat_jax.checkpointing.export_hf(durable=False, write_threads=N)` as the rollout
  sync now runs it (cast + transpose fused per shard, our zero-copy safetensors writer, files
  written on threads while the next is fetched, no fsync), to `--disk-dir`.
- `new-shm`: the same to `--shm-dir` (tmpfs; `rollout.sglang.export_dir`).

Printed: bytes leaving the devices (the fp32 shards) and bytes written, seconds per phase,
GB/s, each path's extrapolation to the 9B's 18 GB of bf16 weights at its measured throughput,
and the old/new ratio last. On CPU the "device -> host" read is a host memory read (jax CPU
arrays are host memory), so the PCIe transfer of a GPU is not in these figures.

  PYTHONPATH=. python experiments/perf/weight_sync.py --layers 2 --repeats 3
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import save as st_serialise, save_file  # noqa: E402

from bat_jax import io_utils, run_programs, sharding  # noqa: E402
from bat_jax.checkpointing import EXPORT_SHARD_BYTES, export_hf  # noqa: E402
from bat_jax.model import ModelConfig, build_model, hf_io  # noqa: E402
from configs import bat9b  # noqa: E402

NINE_B_BF16_BYTES = 18e9  # Qwen3.5-9B text: ~9B params in bf16
BF16 = np.dtype(jnp.bfloat16)
L, F = "linear_attention", "full_attention"


def nine_b_width_config(layers: int, vocab: int, intermediate: int) -> ModelConfig:
  """Qwen3.5-9B's widths and head dims at `layers` depth (its 3 DeltaNet : 1 attention cycle,
  cut short: 2 layers -> DeltaNet + attention)."""
  types = [L, F] if layers == 2 else ([L, L, L, F] * layers)[:layers]
  hf = dict(model_type="qwen3_5_text", vocab_size=vocab, hidden_size=4096,
            intermediate_size=intermediate, num_hidden_layers=layers, layer_types=types,
            num_attention_heads=16, num_key_value_heads=4, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                             "partial_rotary_factor": 0.25},
            max_position_embeddings=4096, tie_word_embeddings=False)
  return ModelConfig.from_hf_dict(hf, dtype=jnp.bfloat16, param_dtype=jnp.float32)


def sharded_model(cfg: ModelConfig) -> nnx.Module:
  """The model built abstractly, each fp32 param filled shard by shard on bat9b's mesh."""
  ref = bat9b.get_config("ckpt=/unused")
  mesh = run_programs.run_mesh(ref)
  abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  shardings = sharding.model_shardings(state, mesh, tuple(ref.sharding.rules))
  flat_sh = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(shardings)}
  rng = np.random.default_rng(0)

  def fill(var, sh):
    want = var.get_value()
    make = lambda idx: (0.02 * rng.standard_normal(
        np.empty(want.shape)[idx].shape, dtype=np.float32)).astype(want.dtype)
    return var.replace(jax.make_array_from_callback(want.shape, sh, make))

  flat = [(tuple(p), fill(v, flat_sh[tuple(p)])) for p, v in nnx.to_flat_state(state)]
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


# -- the old path, as it was (text-only; bat_jax/model/hf_io.py before issue 25's change) --------

def _old_host_value(value: jax.Array, dtype) -> np.ndarray:
  out = np.empty(value.shape, np.dtype(dtype))
  for shard in value.addressable_shards:
    if shard.replica_id == 0:
      out[shard.index] = np.asarray(shard.data).astype(out.dtype, copy=False)
  return out


def _old_to_hf(leaf: str, value: np.ndarray) -> np.ndarray:
  if leaf == "kernel":
    return np.ascontiguousarray(value.T)
  if leaf == "conv_weight":
    return value[:, None, :]
  return value


def _old_file_tensors(model, keys, params, st: dict) -> dict:
  cfg, tensors = model.config, {}
  for key in keys:
    t0 = time.perf_counter()
    device_value = params[key][...]
    value = _old_host_value(device_value, BF16)
    t1 = time.perf_counter()
    slices = list(value) if hf_io._is_stacked(cfg, key) else [value]
    tensors.update({n: _old_to_hf(str(key[-1]), s)
                    for n, s in zip(hf_io._hf_names(cfg, key), slices)})
    st["fetch_cast_s"] += t1 - t0
    st["hf_layout_s"] += time.perf_counter() - t1
    st["bytes_fetched"] += device_value.nbytes  # fp32 off the devices
  return tensors


def _old_save(model, path: Path, st: dict) -> None:
  params = hf_io._param_paths(model)
  sizes = {p: int(np.prod(v.get_value().shape)) * 2 for p, v in params.items()}
  plan = hf_io._plan_files(sizes, EXPORT_SHARD_BYTES)
  path.mkdir(parents=True, exist_ok=True)
  weight_map, total = {}, 0
  for i, keys in enumerate(plan):
    tensors = _old_file_tensors(model, keys, params, st)
    fname = "model.safetensors" if len(plan) == 1 else (
        f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors")
    dest = path / fname
    fd, tmp = tempfile.mkstemp(dir=path, prefix=f".{fname}.", suffix=".tmp")
    os.close(fd)
    t0 = time.perf_counter()
    save_file(tensors, tmp, metadata={"format": "pt"})  # tobytes copy, then the write
    t1 = time.perf_counter()
    io_utils.fsync_file(tmp)
    os.replace(tmp, dest)
    io_utils.fsync_dir(path)
    st["serialise_write_s"] += t1 - t0
    st["fsync_s"] += time.perf_counter() - t1
    st["bytes_written"] += dest.stat().st_size
    weight_map.update({n: fname for n in tensors})
    total += sum(t.nbytes for t in tensors.values())
    del tensors
  t0 = time.perf_counter()
  if len(plan) > 1:
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    io_utils.atomic_write_text(path / hf_io.INDEX_FILE, json.dumps(index, indent=2) + "\n")
  cfg = model.config.replace(param_dtype=jnp.bfloat16)
  io_utils.atomic_write_text(path / "config.json", json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
  st["fsync_s"] += time.perf_counter() - t0  # tiny files: their time is their fsyncs


def old_export(model, path: Path) -> dict:
  """The durable export as the sync ran it (export_hf + save_pretrained before the change)."""
  st = dict.fromkeys(("fetch_cast_s", "hf_layout_s", "serialise_write_s", "fsync_s", "swap_s",
                      "bytes_fetched", "bytes_written"), 0)
  t_start = time.perf_counter()
  staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
  _old_save(model, staging, st)
  t0 = time.perf_counter()
  io_utils.fsync_tree(staging)
  t1 = time.perf_counter()
  old = None
  if path.exists():
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    os.rename(path, old)
  os.rename(staging, path)
  if old is not None:
    shutil.rmtree(old)
  st["fsync_s"] += t1 - t0
  st["swap_s"] = time.perf_counter() - t1
  st["total_s"] = time.perf_counter() - t_start
  return st


def new_export(model, path: Path, threads: int) -> dict:
  st: dict = {}
  t0 = time.perf_counter()
  export_hf(model, path, dtype="bfloat16", durable=False, write_threads=threads, stats=st)
  st["total_s"] = time.perf_counter() - t0
  return st


def serialise_share(model) -> float:
  """Seconds of safetensors' in-memory serialise (its `tobytes` copy) of the whole bf16 model,
  file by file: the part of the old path's `serialise_write_s` that is not the write."""
  params, spent = hf_io._param_paths(model), 0.0
  for key in params:
    tensors = _old_file_tensors(model, [key], params, {"fetch_cast_s": 0, "hf_layout_s": 0,
                                                        "bytes_fetched": 0})
    t0 = time.perf_counter()
    st_serialise(tensors)
    spent += time.perf_counter() - t0
  return spent


def device_read_seconds(model) -> float:
  """Seconds to copy every fp32 shard to a new host buffer (on CPU, a host memcpy standing in
  for the device -> host transfer)."""
  t0 = time.perf_counter()
  for _, var in hf_io._param_paths(model).items():
    for shard in var[...].addressable_shards:
      np.array(shard.data, copy=True)
  return time.perf_counter() - t0


def _gb(n: float) -> str:
  return f"{n / 1e9:.3f} GB"


def report(name: str, runs: list[dict]) -> float:
  """Prints the median of each phase; returns the median wall seconds."""
  med = {k: statistics.median(r.get(k, 0) for r in runs) for k in runs[0]}
  wall, written = med["total_s"], med["bytes_written"]
  phases = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in med.items()
                     if k.endswith("_s") and k != "total_s")
  rate = written / wall
  each = ", ".join(f"{r['total_s']:.2f}" for r in runs)
  print(f"{name:9s} wall {wall:6.2f} s (runs {each})"
        f" | device->host {_gb(med['bytes_fetched'])}, written {_gb(written)}, {rate / 1e9:.2f}"
        f" GB/s written | phases (s): {phases} | 9B (18 GB bf16) at this rate: "
        f"{NINE_B_BF16_BYTES / rate:.1f} s")
  return wall


def parse() -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--intermediate", type=int, default=12288)  # the 9B's MLP width
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--threads", type=int, default=4)  # rollout.sglang.export_threads
  ap.add_argument("--disk-dir", default="/tmp/bat_weight_sync")
  ap.add_argument("--shm-dir", default="/dev/shm/bat_weight_sync")
  return ap.parse_args()


def main() -> None:
  args = parse()
  model = sharded_model(nine_b_width_config(args.layers, args.vocab, args.intermediate))
  n = sum(v[...].size for v in hf_io._param_paths(model).values())
  print(f"model: {n / 1e6:.0f}M params ({args.layers} layers at 9B widths, vocab {args.vocab}), "
        f"fp32 {_gb(4 * n)} on {len(jax.devices())} devices, bf16 export {_gb(2 * n)}; "
        f"{args.threads} writer threads; {os.cpu_count()} CPUs")
  dirs = {"old": Path(args.disk_dir), "new-disk": Path(args.disk_dir),
          "new-shm": Path(args.shm_dir)}
  for d in set(dirs.values()):
    d.mkdir(parents=True, exist_ok=True)
  runs: dict[str, list] = {k: [] for k in dirs}
  for _ in range(args.repeats):  # alternating, so drift in the box's load hits every path
    for name, d in dirs.items():
      out = d / f"export-{name}"
      # The folder stays: from the second repeat on, each export replaces a previous version
      # (the swap removes it), as every sync after the first does.
      runs[name].append(old_export(model, out) if name == "old"
                        else new_export(model, out, args.threads))
  print(f"device->host read alone (host memcpy of the fp32 shards): "
        f"{device_read_seconds(model):.2f} s; safetensors in-memory serialise of the old "
        f"path (part of its serialise_write): {serialise_share(model):.2f} s")
  walls = {name: report(name, r) for name, r in runs.items()}
  for d in set(dirs.values()):
    shutil.rmtree(d, ignore_errors=True)
  print(f"old/new-disk {walls['old'] / walls['new-disk']:.2f}x")
  print(f"old/new (new-shm: rollout.sglang.export_dir on tmpfs) "
        f"{walls['old'] / walls['new-shm']:.2f}x")


if __name__ == "__main__":
  main()
