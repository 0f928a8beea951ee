"""Orbax checkpoints of a training run, and HF export for the rollout server.

One checkpoint step holds three items:

- `state`: the `TrainState` pytree (params, optimizer state, step, RNG, skipped count);
- `data`: the data-iterator state (a grain iterator's `get_state()`: a JSON dict, or bytes, which
  are base64-wrapped);
- `outer`: the outer-loop state as JSON (round, target, curriculum history, baseline scores,
  promotion decisions, ...), with the step number it was saved as.

Orbax writes each step into a temporary directory and renames it only once every item is
committed, so a crash mid-save (even SIGKILL) never leaves a half-written step that
`latest_step()` would return. Saves are asynchronous; `wait()` blocks until they are durable.

A step folder whose stored step is not its name (copied or renamed by hand) is refused: resuming
it would replay or skip data and the LR schedule. `latest_step()` / `restore()` skip it with a
warning naming the folder and both steps; `restore(step=...)` of it raises
`CheckpointIdentityError`.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import jax
import orbax.checkpoint as ocp
from flax import nnx

from bat_jax import io_utils

log = logging.getLogger(__name__)
_ITEMS = ("state", "data", "outer")  # the Composite items of every saved step

JsonLike = Union[dict, list, str, int, float, bool, None]
_BYTES_KEY = "__base64_bytes__"


class CheckpointIdentityError(RuntimeError):
  """A step folder holds a checkpoint saved under another step number."""


def _encode_data_state(data_state: Union[JsonLike, bytes, None]) -> dict:
  if isinstance(data_state, (bytes, bytearray)):
    return {_BYTES_KEY: base64.b64encode(bytes(data_state)).decode("ascii")}
  return {"value": data_state}


def _decode_data_state(stored: Mapping[str, Any]) -> Union[JsonLike, bytes, None]:
  if _BYTES_KEY in stored:
    return base64.b64decode(stored[_BYTES_KEY])
  return stored["value"]


@dataclasses.dataclass(frozen=True)
class Restored:
  """One restored checkpoint step."""
  step: int
  state: Any
  data_state: Union[JsonLike, bytes, None]
  outer_state: JsonLike


def abstract_like(tree: Any) -> Any:
  """`ShapeDtypeStruct`s (keeping shardings) to restore into the layout of `tree`."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
  """Keeps the last `max_to_keep` steps of a run under `directory`.

  Args:
    directory: checkpoint root (created if missing).
    max_to_keep: retained steps (older ones are deleted after a newer one commits).
    async_save: write in a background thread; call `wait()` before reading back or exiting.
  """

  def __init__(self, directory: Union[str, Path], *, max_to_keep: int = 3,
               async_save: bool = True):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
    self.directory = Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, state: Any, *, data_state: Union[JsonLike, bytes, None] = None,
           outer_state: JsonLike = None, force: bool = False) -> bool:
    """Starts saving `step`; returns whether a save was started.

    Args:
      step: the step number (the directory name).
      state: the `TrainState` (or any array pytree).
      data_state: the data iterator's `get_state()` (JSON-able or bytes).
      outer_state: JSON-able outer-loop state.
      force: save even if the manager's policy would skip this step.
    """
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=ocp.args.JsonSave(_encode_data_state(data_state)),
                              outer=ocp.args.JsonSave({"value": outer_state, "step": step}))
    return self._manager.save(step, args=args, force=force)

  def step_problem(self, step: int) -> Optional[str]:
    """Why `step` is not an intact checkpoint (an empty or half-copied directory), or None.

    A cheap structural check: the commit markers and metadata of the step and of each item are
    present, their JSON parses and the stored step is `step` (`identity_problem`). Truncated
    array data is caught by `restore`'s fallback.
    """
    step_dir = self.directory / str(step)
    required = ["commit_success.txt", "_CHECKPOINT_METADATA", "state/_METADATA",
                "state/manifest.ocdbt", "data/metadata", "outer/metadata"]
    required += [f"{item}/commit_success.txt" for item in _ITEMS]
    for rel in required:
      path = step_dir / rel
      if path.is_symlink() or not path.is_file():
        return f"{path} is missing"
    for rel in ("_CHECKPOINT_METADATA", "state/_METADATA", "data/metadata", "outer/metadata"):
      try:
        json.loads((step_dir / rel).read_bytes())
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{step_dir / rel} is not valid JSON ({e})"
    return self.identity_problem(step)

  def identity_problem(self, step: int) -> Optional[str]:
    """Why folder `step` is not step `step` (it holds a checkpoint saved as another step: copied
    or renamed), naming the folder and both steps; None when it is (or predates the record)."""
    path = self.directory / str(step) / "outer" / "metadata"
    try:
      stored = json.loads(path.read_bytes()).get("step", step)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
      return None  # unreadable: step_problem / restore name that
    if isinstance(stored, bool) or stored != step:
      return (f"checkpoint folder {self.directory / str(step)} holds step {stored!r}, not step "
              f"{step} as its name says (copied or renamed?)")
    return None

  def intact_steps(self) -> list[int]:
    """Committed steps that pass `step_problem`, ascending; broken ones are logged and skipped."""
    steps = []
    for step in self.all_steps():
      problem = self.step_problem(step)
      if problem is None:
        steps.append(step)
      else:
        log.warning("checkpoint step %d under %s is broken (%s): skipping it", step,
                    self.directory, problem)
    return steps

  def latest_step(self) -> Optional[int]:
    """The newest intact committed step, or None (an empty or half-copied newer step is
    skipped with a warning naming it)."""
    steps = self.intact_steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, template: Any, step: Optional[int] = None) -> Restored:
    """Restores `step` (default: the newest intact one) into the structure, dtypes and
    shardings of `template`.

    With the default, a step that fails to restore (truncated data, bad outer state) is skipped
    with a warning naming it, and the next older intact step is restored instead.

    Raises:
      FileNotFoundError: naming the directory when there is no such committed step.
      RuntimeError: naming the step directory when no candidate step restores.
      CheckpointIdentityError: (a RuntimeError) the explicit `step`'s folder holds another
        step's checkpoint.
    """
    if step is not None:
      if step not in self._manager.all_steps():
        raise FileNotFoundError(f"no committed checkpoint step {step} under {self.directory} "
                                f"(have {self.all_steps()})")
      return self._restore_step(template, step)
    candidates = self.intact_steps()[::-1]
    if not candidates:
      raise FileNotFoundError(f"no committed checkpoint step None under {self.directory} "
                              f"(no intact step; have {self.all_steps()})")
    failures = []
    for candidate in candidates:
      try:
        return self._restore_step(template, candidate)
      except RuntimeError as e:
        failures.append(str(e))
        log.warning("%s; falling back to an older step", e)
    raise RuntimeError("no checkpoint step restores: " + "; ".join(failures))

  def _restore_step(self, template: Any, step: int) -> Restored:
    problem = self.identity_problem(step)
    if problem is not None:
      raise CheckpointIdentityError(f"checkpoint step {self.directory / str(step)} does not "
                                    f"restore: {problem}")
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_like(template)),
                              data=ocp.args.JsonRestore(), outer=ocp.args.JsonRestore())
    try:
      out = self._manager.restore(step, args=args)
      return Restored(step=step, state=out.state, data_state=_decode_data_state(out.data),
                      outer_state=out.outer["value"])
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types; name the step
      raise RuntimeError(f"checkpoint step {self.directory / str(step)} does not restore: "
                         f"{type(e).__name__}: {e}") from e

  def wait(self) -> None:
    """Blocks until every started save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# Rollout exports go out in files of at most this many bytes (+ an index), written one at a time.
EXPORT_SHARD_BYTES = 2 * 2**30


# Old versions that non-durable exports remove in the background, by export path: the next
# export of that path first waits for it, so at most two versions are ever on disk.
_REMOVALS: dict[Path, threading.Thread] = {}


def _finish_removals(path: Path) -> None:
  """Waits for the background removal of `path`'s previous version; removes leftovers of one
  cut short (a process that exited mid-removal)."""
  pending = _REMOVALS.pop(path, None)
  if pending is not None:
    pending.join()
  for stale in path.parent.glob(f".{path.name}.old-*"):
    shutil.rmtree(stale, ignore_errors=True)


def export_hf(model: nnx.Module, path: Union[str, Path], *, params: Any = None,
              tokenizer_dir: Optional[Union[str, Path]] = None, dtype: Any = None,
              vision_source: Optional[Union[str, Path]] = None,
              max_shard_bytes: int = EXPORT_SHARD_BYTES, durable: bool = True,
              write_threads: int = 1, stats: Optional[dict] = None) -> Path:
  """Writes HF safetensors + config.json for the rollout server, atomically.

  Params are written from their shards, one leaf at a time, each shard cast to `dtype` on the
  host (`bat_jax.model.save_pretrained`): no cast copy and no gathered tree on any device.

  Args:
    model: the policy module (its graph and non-param state are used).
    path: destination directory; replaced as a whole, so a reader never sees a mix of versions.
    params: optional `nnx.Param` state (e.g. `TrainState.params`) to export instead of the
      module's own; the module is not modified.
    tokenizer_dir: tokenizer files to copy alongside.
    dtype: weights' storage dtype on disk (e.g. "bfloat16" for SGLang, which maps a float32
      config.json to float16 under `--dtype auto`); config.json's `dtype` says the same. None
      keeps the param dtype. The fp32 master weights stay in the orbax checkpoint.
    vision_source: the pretrained checkpoint whose vision tower and preprocessor files a
      multimodal (`qwen3_5`) export carries (SGLang serves Qwen3.5 only as
      `Qwen3_5ForConditionalGeneration`, which builds them).
    max_shard_bytes: the largest safetensors file (more files get an index).
    durable: fsync every file and the folder before the swap (evaluation exports, the final
      model). False, for the per-step rollout sync: no fsync at all (a crash redoes the sync),
      and the old version is removed on a background thread after the swap (the next export
      of `path` waits for it); the new version is still written into a staging folder and
      renamed into place, so a reader sees the old version or the whole new one.
    write_threads: safetensors files written at once while the next is fetched
      (`save_pretrained`).
    stats: optional dict of seconds and bytes per phase (`save_pretrained`'s, plus swap_s: the
      rename and the removal of the old version, and fsync_s of the tree when durable).

  Returns:
    The destination path.
  """
  from bat_jax.model import save_pretrained  # the model package owns the HF layout

  if params is not None:
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    model = nnx.merge(graphdef, params, rest)  # a new module: the caller's is not modified
  save = lambda d: save_pretrained(model, d, tokenizer_dir=tokenizer_dir, dtype=dtype,
                                   vision_source=vision_source, max_shard_bytes=max_shard_bytes,
                                   durable=durable, write_threads=write_threads, stats=stats)
  path = Path(path).absolute()
  if jax.process_index() != 0:
    save(path)  # multi-host: every process joins each leaf's spread; only process 0 writes
    return path
  path.parent.mkdir(parents=True, exist_ok=True)
  _finish_removals(path)
  staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
  try:
    save(staging)
    t0 = t1 = time.perf_counter()
    if durable:
      io_utils.fsync_tree(staging)
      t1 = time.perf_counter()
    old = None
    if path.exists():
      old = path.parent / f".{path.name}.old-{os.getpid()}"
      os.rename(path, old)
    os.rename(staging, path)
    if old is not None and durable:
      shutil.rmtree(old)
    elif old is not None:  # the sync: the server's load of the new version overlaps this
      _REMOVALS[path] = threading.Thread(target=shutil.rmtree, args=(old, True), daemon=True,
                                         name=f"remove {old.name}")
      _REMOVALS[path].start()
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  if stats is not None:
    stats["fsync_s"] = stats.get("fsync_s", 0) + t1 - t0
    stats["swap_s"] = stats.get("swap_s", 0) + time.perf_counter() - t1  # rename + old removed
  return path
