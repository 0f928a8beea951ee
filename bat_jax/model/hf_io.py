"""Hugging Face checkpoint import / export (safetensors + config.json).

Weight names follow transformers exactly:
* `qwen3`, `qwen3_5_text`: `model.*` + `lm_head.weight` (CausalLM layout).
* `qwen3_5` (multimodal): `model.language_model.*` + `lm_head.weight`; the
  vision tower (`model.visual.*`) and MTP head (`mtp.*`) are skipped, logged.

NNX param paths map onto HF names mechanically: `kernel` -> `weight`
(transposed, torch Linear is [out, in]), `embedding` -> `weight`,
`conv_weight` [C, K] -> `conv1d.weight` [C, 1, K]. Values are copied without
any arithmetic, so import -> export -> import is bit-identical.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open

from bat_jax import io_utils, sharding
from bat_jax.model.config import CONFIG_FILE, ModelConfig
from bat_jax.model.decoder import CausalLM, build_model
from bat_jax.model.hf_write import add_stats, fetch_hf_layout, write_safetensors

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
# Checkpoint parts that are not the language model: skipped with a log line.
_SKIPPED_PREFIXES = ("model.visual.", "mtp.")


# -- name mapping -------------------------------------------------------------


def _prefix(cfg: ModelConfig) -> str:
  return "model.language_model." if cfg.is_multimodal_layout else "model."


def _hf_name(cfg: ModelConfig, path: tuple) -> str:
  """Unstacked NNX param path (`layers`, HF layer index, ...) -> HF tensor name."""
  if path == ("lm_head",):
    return "lm_head.weight"
  parts = [str(p) for p in path]
  leaf = parts[-1]
  if leaf in ("kernel", "embedding"):
    parts[-1] = "weight"
  elif leaf == "conv_weight":
    parts[-1:] = ["conv1d", "weight"]
  return _prefix(cfg) + ".".join(parts)


def _hf_names(cfg: ModelConfig, path: tuple) -> list[str]:
  """HF names of one NNX param: one name, or one per cycle when the param is
  stacked (`layers[j]` with `scan_layers`: HF layers j, j + P, j + 2P, ...)."""
  if cfg.scan_layers and path[0] == "layers":
    period, pos = cfg.layer_cycle, int(path[1])
    return [_hf_name(cfg, ("layers", c * period + pos, *path[2:]))
            for c in range(cfg.num_cycles)]
  return [_hf_name(cfg, path)]


def _is_stacked(cfg: ModelConfig, path: tuple) -> bool:
  return cfg.scan_layers and path[0] == "layers"


def _to_hf(leaf: str, value: np.ndarray) -> np.ndarray:
  if leaf == "kernel":
    return np.ascontiguousarray(value.T)
  if leaf == "conv_weight":
    return value[:, None, :]
  return value


def _hf_shape_to_nnx(leaf: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  if leaf == "kernel":
    return tuple(reversed(shape))
  if leaf == "conv_weight" and len(shape) == 3 and shape[1] == 1:
    return (shape[0], shape[2])
  return tuple(shape)


def _param_paths(model: CausalLM) -> dict[tuple, nnx.Variable]:
  return {tuple(path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def host_value(value: jax.Array, dtype=None) -> np.ndarray:
  """One param on this host as numpy in `dtype` (default: its own), assembled from this
  process's shards, each cast on the host straight into place (`hf_write.fetch_hf_layout`)."""
  return fetch_hf_layout(value, dtype)


def _hf_tensors(cfg: ModelConfig, path: tuple, value: jax.Array, dtype=None,
                stats: dict | None = None, threads: int = 1) -> dict[str, np.ndarray]:
  """One param's HF tensors fetched from its shards in `dtype` (a stacked param: one per HF
  layer). Kernels are cast and transposed in one pass per shard; conv weights get their
  singleton axis as a view; per-layer slices of a stacked param are views of one array."""
  leaf = str(path[-1])
  t0 = time.perf_counter()
  host = fetch_hf_layout(value, dtype, transpose=leaf == "kernel", threads=threads)
  # bytes_fetched: what leaves the devices (the params' own dtype; the cast is on the host).
  add_stats(stats, fetch_s=time.perf_counter() - t0,
            bytes_fetched=value.size * value.dtype.itemsize)
  if leaf == "conv_weight":
    host = host[..., :, None, :]
  slices = list(host) if _is_stacked(cfg, path) else [host]
  return dict(zip(_hf_names(cfg, path), slices))


def hf_state_dict(model: CausalLM, dtype=None) -> dict[str, np.ndarray]:
  """All params as host numpy arrays under their HF names (`dtype`, default the param dtype),
  fetched one leaf at a time from their shards (`host_value`); stacked (scanned) params are
  split back into one tensor per HF layer."""
  out = {}
  for path, var in _param_paths(model).items():
    out.update(_hf_tensors(model.config, path, var[...], dtype))
  return out


# -- reading ------------------------------------------------------------------


def _checkpoint_files(path: Path) -> dict[str, Path]:
  """HF tensor name -> safetensors file holding it."""
  index = path / INDEX_FILE
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise ValueError(f"{index} is not a valid safetensors index (needs 'weight_map'): {e}") from e
    files = {name: path / fname for name, fname in weight_map.items()}
    for f in sorted(set(files.values())):
      if not f.is_file():
        raise FileNotFoundError(f"weights file {f} listed in {index} does not exist")
    return files
  single = path / SINGLE_FILE
  if not single.is_file():
    raise FileNotFoundError(f"no weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE}")
  with safe_open(single, framework="numpy") as f:
    return {name: single for name in f.keys()}


def _check_names(path: Path, files: Mapping[str, Path], expected: set[str],
                 cfg: ModelConfig) -> None:
  """Raises KeyError naming missing / unexpected weights; logs skipped ones."""
  skipped = sorted(n for n in files if n not in expected and n.startswith(_SKIPPED_PREFIXES))
  if skipped:
    parts = sorted({n.split(".")[1] if n.startswith("model.") else n.split(".")[0] for n in skipped})
    log.info("load_pretrained: skipping %d non-language-model tensors (%s) in %s",
             len(skipped), ", ".join(parts), path)
  if cfg.tie_word_embeddings and "lm_head.weight" in files:
    skipped.append("lm_head.weight")  # tied: the embedding table is the head
    log.info("load_pretrained: ignoring lm_head.weight (tie_word_embeddings=true)")
  unexpected = sorted(set(files) - expected - set(skipped))
  if unexpected:
    where = sorted({files[n].name for n in unexpected})
    raise KeyError(f"unexpected weights in {path} ({', '.join(where)}): {unexpected[:10]}"
                   + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""))
  missing = sorted(expected - set(files))
  if missing:
    raise KeyError(f"missing weights in {path}: {missing[:10]}"
                   + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""))


class _TensorReader:
  """Slices of checkpoint tensors in NNX layout, read lazily (safetensors
  `get_slice`: only the requested rows/columns leave the file)."""

  def __init__(self, files: Mapping[str, Path], stack: contextlib.ExitStack):
    self._files = files
    self._handles = {f: stack.enter_context(safe_open(f, framework="numpy"))
                     for f in sorted(set(files.values()))}

  def nnx_shape(self, name: str, leaf: str) -> tuple[int, ...]:
    return _hf_shape_to_nnx(leaf, tuple(self._handles[self._files[name]].get_slice(name).get_shape()))

  def read(self, name: str, leaf: str, index: tuple[slice, ...]) -> np.ndarray:
    """`tensor[index]` in NNX layout (kernels transposed, conv squeezed)."""
    view = self._handles[self._files[name]].get_slice(name)
    if leaf == "kernel":
      return np.ascontiguousarray(view[index[1], index[0]].T)
    if leaf == "conv_weight" and len(view.get_shape()) == 3:
      return view[index[0], :, index[1]][:, 0, :]
    return view[index] if index else view[:]


def _load_param(reader: _TensorReader, names: list[str], leaf: str, stacked: bool,
                abstract: jax.ShapeDtypeStruct, sharding_: jax.sharding.Sharding) -> jax.Array:
  """One param built shard by shard: each device's callback reads only its slice."""
  dtype = abstract.dtype

  def shard(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(index)
    if not stacked:
      return reader.read(names[0], leaf, index).astype(dtype)
    return np.stack([reader.read(name, leaf, index[1:]).astype(dtype)
                     for name in names[index[0]]])

  return jax.make_array_from_callback(abstract.shape, sharding_, shard)


def load_pretrained(path: str | Path, *, dtype=None, param_dtype=None, mesh: Mesh | None = None,
                    rules: sharding.Rules | None = None,
                    scan_layers: bool | None = None) -> CausalLM:
  """Loads an HF Qwen3 / Qwen3.5 checkpoint directory into a `CausalLM`.

  The model is built abstractly (`nnx.eval_shape`, nothing allocated) and each
  param is assembled from per-device slices read straight from the
  safetensors files, so no tensor ever lands whole on one device.

  Args:
    path: directory with config.json and model.safetensors (or a sharded
      model.safetensors.index.json).
    dtype: compute dtype (default fp32). param_dtype: storage dtype (default fp32).
    mesh: place every param on this mesh per its logical axes and `rules`
      (default `sharding.DEFAULT_RULES`); None: this process's first device.
    scan_layers: override `ModelConfig.scan_layers` (default: stacked).
  Raises:
    FileNotFoundError naming a missing config / weights file; KeyError naming
    missing or unexpected weights; ValueError naming a shape mismatch or an
    unsupported model_type.
  """
  path = Path(path)
  cfg = ModelConfig.from_pretrained_dir(path, dtype=dtype, param_dtype=param_dtype)
  if scan_layers is not None:
    cfg = cfg.replace(scan_layers=scan_layers)
  files = _checkpoint_files(path)
  abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  params = _param_paths(abstract)
  names = {p: _hf_names(cfg, p) for p in params}
  _check_names(path, files, {n for ns in names.values() for n in ns}, cfg)
  if mesh is None:
    shardings = {p: jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) for p in params}
  else:
    tree = sharding.model_shardings(state, mesh, rules or sharding.DEFAULT_RULES)
    shardings = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(tree)}

  values = {}
  with contextlib.ExitStack() as stack:
    reader = _TensorReader(files, stack)
    for p, var in params.items():
      leaf, want = str(p[-1]), var.get_value()
      per_layer = want.shape[1:] if _is_stacked(cfg, p) else want.shape
      for name in names[p]:
        got = reader.nnx_shape(name, leaf)
        if got != tuple(per_layer):
          raise ValueError(
              f"shape mismatch for weight {name!r} in {files[name].name}: checkpoint has "
              f"{_to_hf(leaf, np.empty(got)).shape}, model expects "
              f"{_to_hf(leaf, np.empty(per_layer)).shape}")
      values[p] = _load_param(reader, names[p], leaf, _is_stacked(cfg, p), want, shardings[p])
  flat = nnx.to_flat_state(state)
  new_flat = [(tuple(p), v.replace(values[tuple(p)]) if tuple(p) in values else v) for p, v in flat]
  return nnx.merge(graphdef, nnx.from_flat_state(new_flat))


# -- writing ------------------------------------------------------------------


# Files a multimodal (`qwen3_5`) export carries from its source checkpoint beside the vision
# tower: SGLang's `Qwen3_5ForConditionalGeneration` builds the tower and its processor.
PREPROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")
_VISION_PREFIX = "model.visual."


def _plan_files(sizes: Mapping[tuple, int], max_shard_bytes: int | None) -> list[list[tuple]]:
  """Params (in order) grouped into files of at most `max_shard_bytes` (a param never splits;
  one bigger than the limit gets a file of its own)."""
  files: list[list[tuple]] = [[]]
  size = 0
  for key, nbytes in sizes.items():
    if files[-1] and max_shard_bytes and size + nbytes > max_shard_bytes:
      files.append([])
      size = 0
    files[-1].append(key)
    size += nbytes
  return files


def _vision_tensors(source: Path, dtype) -> dict[str, tuple[int, Callable[[], np.ndarray]]]:
  """`name -> (bytes on disk, reader)` of the source checkpoint's vision-tower tensors (cast to
  `dtype` when floating)."""
  files = {n: f for n, f in _checkpoint_files(source).items() if n.startswith(_VISION_PREFIX)}
  if not files:
    raise ValueError(f"vision_source {source} holds no {_VISION_PREFIX}* tensors")
  if not (source / PREPROCESSOR_FILES[0]).is_file():
    raise FileNotFoundError(f"vision_source {source} has no {PREPROCESSOR_FILES[0]} (SGLang "
                            "builds the vision processor from it)")

  def read(name: str) -> np.ndarray:
    with safe_open(files[name], framework="numpy") as f:
      t = f.get_tensor(name)
    return t.astype(dtype) if np.issubdtype(t.dtype, np.floating) else t

  out = {}
  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(safe_open(f, framework="numpy")) for f in set(files.values())}
    for n in sorted(files):
      shape = handles[files[n]].get_slice(n).get_shape()
      out[n] = (int(np.prod(shape)) * np.dtype(dtype).itemsize, lambda n=n: read(n))
  return out


def _write_files(model: CausalLM, path: Path, plan: list[list[tuple]], extra: Mapping,
                 out_dtype: np.dtype, *, durable: bool, write_threads: int,
                 stats: dict | None) -> tuple[dict[str, str], int]:
  """Fetches each planned file's tensors (in plan order: every process joins each leaf's
  collective in the same order) and writes the file on a pool of `write_threads` writers, so
  fetching file i + 1 overlaps writing file i; at most `write_threads` files wait in host
  memory. Returns the weight map and the bytes of tensor data written (process 0; others
  write nothing)."""
  cfg, params = model.config, _param_paths(model)
  writer = jax.process_index() == 0
  names = [SINGLE_FILE] if len(plan) == 1 else [
      f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
  weight_map, total, pending = {}, 0, []
  with ThreadPoolExecutor(max_workers=write_threads, thread_name_prefix="hf-write") as pool:
    for fname, keys in zip(names, plan):
      tensors = {}
      for key in keys:
        if key in params:
          got = _hf_tensors(cfg, key, params[key][...], out_dtype, stats,
                            threads=write_threads)  # every process joins
          tensors.update(got if writer else {})
        elif writer:
          tensors[key[0]] = extra[key[0]][1]()
      if not writer:
        continue
      weight_map.update({name: fname for name in tensors})
      total += sum(t.nbytes for t in tensors.values())
      pending.append(pool.submit(write_safetensors, path / fname, tensors, durable=durable,
                                 metadata={"format": "pt"}, stats=stats))  # "pt": transformers
      del tensors
      _wait_until_fewer(pending, write_threads)
    _wait_until_fewer(pending, 1)
  return weight_map, total


def _wait_until_fewer(pending: list[Future], limit: int) -> None:
  """Waits (oldest first) until fewer than `limit` writes are pending; re-raises a failed one."""
  while len(pending) >= limit and pending:
    pending.pop(0).result()


def save_pretrained(model: CausalLM, path: str | Path, *, tokenizer_dir: str | Path | None = None,
                    max_shard_bytes: int | None = None, dtype=None,
                    vision_source: str | Path | None = None, durable: bool = True,
                    write_threads: int = 1, stats: dict | None = None) -> Path:
  """Writes an HF checkpoint: safetensors, config.json, and tokenizer files from `tokenizer_dir`.

  Params are fetched one at a time from their shards, each shard cast (and a kernel transposed)
  on the host straight into its HF layout (`hf_write.fetch_hf_layout`); with `max_shard_bytes`,
  each file holds at most that many bytes (`model-0000i-of-0000n.safetensors` +
  `model.safetensors.index.json`), so the host holds a few files' tensors, and the devices
  nothing beyond the sharded params.

  Args:
    dtype: storage dtype on disk (default the param dtype); config.json says the same.
    vision_source: for the multimodal layout, the checkpoint whose vision tower
      (`model.visual.*`, cast to `dtype`) and preprocessor files are carried into the export.
    durable: fsync every file and the folder (evaluation exports, the final model). False (the
      per-step rollout sync, which a crash redoes) skips every fsync.
    write_threads: files written at once while the next file's tensors are fetched, and
      shards of a leaf cast at once.
    stats: optional dict that gets fetch_s, bytes_fetched, write_s, fsync_s, bytes_written
      (seconds summed over the writer threads).

  Every file is written atomically (tmp + rename). On multi-host runs all processes must call
  this (a leaf that spans processes is spread over each host's devices) and process 0 writes.
  """
  if not isinstance(write_threads, int) or isinstance(write_threads, bool) or write_threads < 1:
    raise ValueError(f"save_pretrained: write_threads must be an int >= 1, got {write_threads!r}")
  path = Path(path)
  cfg = model.config
  out_dtype = np.dtype(dtype or cfg.param_dtype)
  params = _param_paths(model)
  sizes = {p: int(np.prod(v.get_value().shape)) * out_dtype.itemsize for p, v in params.items()}
  extra = _vision_tensors(Path(vision_source), out_dtype) if vision_source else {}
  if extra and not cfg.is_multimodal_layout:
    raise ValueError(f"vision_source {vision_source} given for a text-only model "
                     f"(model_type {cfg.model_type!r})")
  plan = _plan_files({**sizes, **{(n,): size for n, (size, _) in extra.items()}},
                    max_shard_bytes)
  writer = jax.process_index() == 0
  if writer:
    path.mkdir(parents=True, exist_ok=True)
    for f in [path / SINGLE_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
      f.unlink(missing_ok=True)
  weight_map, total = _write_files(model, path, plan, extra, out_dtype, durable=durable,
                                   write_threads=write_threads, stats=stats)
  if not writer:
    return path
  write = lambda name, text: io_utils.atomic_write_bytes(path / name, text.encode("utf-8"),
                                                         durable=durable)
  if len(plan) > 1:
    index = {"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))}
    write(INDEX_FILE, json.dumps(index, indent=2) + "\n")
  written = cfg if dtype is None else cfg.replace(param_dtype=jnp.dtype(dtype))
  write(CONFIG_FILE, json.dumps(written.to_hf_dict(), indent=2) + "\n")
  copies = [(Path(tokenizer_dir), TOKENIZER_FILES, "tokenizer_dir")] if tokenizer_dir else []
  copies += [(Path(vision_source), PREPROCESSOR_FILES, "vision_source")] if vision_source else []
  for source, names, field in copies:
    if not source.is_dir():
      raise FileNotFoundError(f"{field} {source} does not exist")
    for name in names:
      if (source / name).is_file():
        io_utils.atomic_write_bytes(path / name, (source / name).read_bytes(), durable=durable)
  return path
