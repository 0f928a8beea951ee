"""Device mesh, logical-axis rules and NamedSharding helpers (pjit style).

Params carry logical axis names as NNX metadata (`out_sharding`, set by
`bat_jax.model.layers.logical_param`). A rule table maps each logical name to
a mesh axis (or a tuple of mesh axes, or None = replicated); real runs take the
rules from their config, `DEFAULT_RULES` is the FSDP + tensor-parallel default.

The same code runs on 1 CPU device, on 8 fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`) and on N GPUs across
hosts (call `maybe_initialize_distributed()` first). A mesh axis that does not
evenly divide a dimension is dropped for that dimension (replicated) instead of
failing, so tiny test models shard on any mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]
# Logical axes of the residual stream [B, T, D] at layer boundaries.
ACTIVATION_AXES = ("batch", "length", "activation_embed")

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("activation_embed", None),
    # stacked (scanned) layer axis of params
    ("layers", None),
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("norm", None),
    ("embed_norm", None),
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh over `devices` (default: all devices).

  One axis size may be -1 (inferred). The product must equal the device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis size may be -1, got data={data} fsdp={fsdp} "
                     f"tensor={tensor}")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices do not split into mesh data={data} "
                       f"fsdp={fsdp} tensor={tensor}")
    sizes[sizes.index(-1)] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f"mesh data={sizes[0]} fsdp={sizes[1]} tensor={sizes[2]} needs "
                     f"{int(np.prod(sizes))} devices, have {len(devices)}")
  try:
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(tuple(sizes), devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    # Topology-aware placement is unavailable for some device sets (e.g. a subset).
    grid = np.asarray(devices, dtype=object).reshape(sizes)
  return Mesh(grid, MESH_AXES)


def _rule_table(rules: Rules) -> dict[str, MeshAxes]:
  table: dict[str, MeshAxes] = {}
  for entry in rules:
    if len(entry) != 2:
      raise ValueError(f"sharding rule {entry!r} must be (logical_name, mesh_axes)")
    name, axes = entry
    for ax in (axes,) if isinstance(axes, str) else (axes or ()):
      if ax not in MESH_AXES:
        raise ValueError(f"sharding rule for {name!r} names unknown mesh axis {ax!r}; "
                         f"mesh axes are {MESH_AXES}")
    table.setdefault(name, axes)  # first rule wins, as in flax/MaxText
  return table


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules,
                    shape: Sequence[int] | None = None, mesh: Mesh | None = None) -> PartitionSpec:
  """PartitionSpec for one array's logical axes.

  With `shape` and `mesh`, mesh axes that do not divide their dimension (or
  were already used by an earlier dimension) are dropped for that dimension.
  """
  table = _rule_table(rules)
  used: set[str] = set()
  spec = []
  for dim, name in enumerate(logical_axes):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise KeyError(f"no sharding rule for logical axis {name!r}; rules cover {sorted(table)}")
    axes = table[name]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    kept = []
    for ax in axes:
      if ax in used:
        continue
      if shape is not None and mesh is not None:
        size = int(np.prod([mesh.shape[a] for a in (*kept, ax)]))
        if shape[dim] % size:
          continue
      kept.append(ax)
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*spec)


def _variable_sharding(var: nnx.Variable, mesh: Mesh, rules: Rules) -> NamedSharding:
  axes = var.get_metadata().get("out_sharding")
  shape = var.get_value().shape
  if not axes:
    return NamedSharding(mesh, PartitionSpec())
  return NamedSharding(mesh, logical_to_spec(axes, rules, shape=shape, mesh=mesh))


def model_shardings(model_or_state: nnx.Module | nnx.State, mesh: Mesh,
                    rules: Rules = DEFAULT_RULES) -> nnx.State:
  """NamedSharding for every variable, in the structure of the model's state.

  Variables without logical axes are replicated. Works on abstract states
  (from `nnx.eval_shape`) too. The result is a `State` whose Variables hold
  NamedShardings, usable directly as jit in/out shardings of that state.
  """
  state = (nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module)
           else model_or_state)
  return jax.tree.map(lambda v: v.replace(_variable_sharding(v, mesh, rules)), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


_ACTIVATION_SHARDING: contextvars.ContextVar[tuple[Mesh, tuple] | None] = contextvars.ContextVar(
    "activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES):
  """Within this context, `constrain` pins activations to `rules` on `mesh`.

  The model names logical axes only (`constrain(x, ACTIVATION_AXES)`); the
  mesh and rules come from here, MaxText style. It must be active while a
  function is traced (`jit(...).lower`, or the first call), since constraints
  are recorded at trace time. Outside it `constrain` is the identity.
  """
  _rule_table(rules)  # validate early
  token = _ACTIVATION_SHARDING.set((mesh, tuple(rules)))
  try:
    yield
  finally:
    _ACTIVATION_SHARDING.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` of x to its logical axes under the active
  `activation_sharding` context (identity without one, or on a 1-device mesh)."""
  active = _ACTIVATION_SHARDING.get()
  if active is None:
    return x
  mesh, rules = active
  if mesh.size == 1:
    return x
  if len(logical_axes) != x.ndim:
    raise ValueError(f"logical axes {tuple(logical_axes)} do not match activation shape {x.shape}")
  spec = logical_to_spec(logical_axes, rules, shape=x.shape, mesh=mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def active_mesh() -> tuple[Mesh, tuple] | None:
  """`(mesh, rules)` of the active `activation_sharding` context (None outside one or on a
  1-device mesh): for code that maps over devices explicitly (`jax.shard_map`)."""
  active = _ACTIVATION_SHARDING.get()
  return None if active is None or active[0].size == 1 else active


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Leading (batch) dim over ("data", "fsdp"); other dims replicated."""
  if ndim < 1:
    raise ValueError(f"batch_sharding needs ndim >= 1, got {ndim}")
  return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def _host_major_mesh() -> Mesh:
  """A `("hosts", "local")` mesh over every device, one row per process (in process order)."""
  rows = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
          for p in range(jax.process_count())]
  return Mesh(np.asarray(rows, dtype=object), ("hosts", "local"))


def _local_spec(x: jax.Array, local: int) -> PartitionSpec:
  """The spec that splits `x` over a host's devices: the first dim its own spec shards that
  divides by the local device count, else the first dim that does; replicated when none does."""
  spec = tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else ()
  dims = [d for d, s in enumerate(spec) if s is not None] + list(range(x.ndim))
  for d in dims:
    if x.shape[d] % local == 0:
      return PartitionSpec(*([None] * d), "local")
  return PartitionSpec()


def host_local(tree: Any) -> Any:
  """This process's own copy of a (possibly multi-host) array tree, sharded over its local
  devices, e.g. for an in-process rollout engine; the tree itself with one process.

  Each leaf is resharded once onto a `("hosts", "local")` mesh (replicated over hosts, split
  over each host's devices) and the process keeps its addressable shards as a process-local
  array: no leaf is ever gathered whole onto one device (a host's devices each hold 1/local).
  Every process must call this (the reshard is a collective).
  """
  if jax.process_count() == 1:
    return tree
  mesh = _host_major_mesh()
  local_devices = list(mesh.devices[jax.process_index()])
  local_mesh = Mesh(np.asarray(local_devices, dtype=object), ("local",))

  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    spec = _local_spec(x, len(local_devices))
    spread = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, spec))(x)
    by_device = {s.device: s.data for s in spread.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(local_mesh, spec), [by_device[d] for d in local_devices])

  return jax.tree.map(one, tree)


def mesh_shape_for_hosts(data: int, fsdp: int, tensor: int, hosts: int = 1) -> dict[str, int]:
  """The mesh a config's axis sizes give on `hosts` hosts: the -1 axis (the one that spans
  hosts, `data` in the reference configs) is `hosts`, the others as given."""
  if hosts < 1:
    raise ValueError(f"hosts must be >= 1, got {hosts}")
  return {a: hosts if s == -1 else s for a, s in zip(MESH_AXES, (data, fsdp, tensor))}


def batch_divisibility_problems(mesh_shape: Mapping[str, int], rules: Rules,
                                batches: Mapping[str, int]) -> list[str]:
  """Batch dims that do not split over the mesh axes they are sharded on.

  A batch's rows are placed over ("data", "fsdp") (`batch_sharding`) and its activations over
  the axes the `batch` rule names; `logical_to_spec` would silently drop an axis that does not
  divide (every device of it then holds the rows again). `batches` maps what a batch is (naming
  its config fields) to its rows. Returns one message per batch that does not divide.
  """
  rule_axes = _rule_table(rules).get("batch")
  rule_axes = (rule_axes,) if isinstance(rule_axes, str) else tuple(rule_axes or ())
  axes = tuple(dict.fromkeys(("data", "fsdp", *rule_axes)))
  ways = int(np.prod([mesh_shape[a] for a in axes]))
  split = " x ".join(f"{a}={mesh_shape[a]}" for a in axes)
  return [f"{what} = {rows} rows does not split over the {ways} devices it is sharded on "
          f"({split}): it needs a multiple of {ways} rows"
          for what, rows in batches.items() if rows % ways]


def bytes_per_device(tree: Any) -> dict[jax.Device, int]:
  """Bytes of `tree`'s arrays on each of this process's devices (a replicated leaf counts on every
  device that holds a copy): how evenly a policy copy, or `jax.live_arrays()`, is spread."""
  out: dict[jax.Device, int] = {d: 0 for d in jax.local_devices()}
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      for shard in leaf.addressable_shards:
        out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


def live_bytes_per_device(arrays: Any = None) -> dict[jax.Device, int]:
  """Device bytes held by `arrays` (default `jax.live_arrays()`), each device buffer counted once.

  Summing `jax.live_arrays()` counts a buffer once per array viewing it: a sharded array's
  per-shard arrays (`shard.data`, which orbax's save creates and keeps for every shard: on CPU
  its host "copy" is a zero-copy view) are live arrays too, so after a checkpoint save the sum
  shows the saved params two or three times over although no byte more is held."""
  out: dict[jax.Device, int] = {d: 0 for d in jax.local_devices()}
  seen: set[tuple[int, int]] = set()
  for leaf in jax.tree.leaves(jax.live_arrays() if arrays is None else arrays):
    if not isinstance(leaf, jax.Array) or leaf.is_deleted():
      continue
    for shard in leaf.addressable_shards:
      key = (shard.device.id, shard.data.unsafe_buffer_pointer())
      if key not in seen:
        seen.add(key)
        out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


_DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
_LAUNCHER_SIZE_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def maybe_initialize_distributed(env: Mapping[str, str] | None = None) -> bool:
  """Calls `jax.distributed.initialize()` when launched as a multi-process job.

  Multi-process is detected from a coordinator address or a launcher world
  size > 1 (SLURM, Open MPI, PMI); jax fills in the rest from the environment.
  Must run before any other jax call. Returns True when initialised.
  """
  env = os.environ if env is None else env
  multi = any(env.get(k) for k in _DISTRIBUTED_ENV) or any(
      int(env.get(k, "1") or "1") > 1 for k in _LAUNCHER_SIZE_ENV)
  if not multi:
    return False
  jax.distributed.initialize()
  log.info("jax.distributed initialised: process %d of %d, %d global devices",
           jax.process_index(), jax.process_count(), jax.device_count())
  return True
