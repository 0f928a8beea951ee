"""One jitted, sharded optimisation step shared by SFT and GRPO (MaxText's `train_step`).

The step is `(state, batch, frozen) -> (state, metrics)`:

- `state` (`TrainState`, donated) holds params, optax state, step, RNG and the skipped-update count.
- `batch` is a dict of named `[B, ...]` arrays (never a positional tuple).
- `frozen` holds what the step reads but never updates: the model's non-parameter variables and,
  for KL, the frozen reference params.

The objective is a `LossFn(model, micro_batch, ref_model, remat_policy) -> (numerator,
denominator, stats)`; it forwards `remat_policy` to the model's per-layer rematerialisation.
Micro-batches are scanned with `lax.scan`; gradients of the numerators and the denominators are
summed and divided once, so accumulation equals the full batch exactly. A non-finite loss or
gradient, or an all-masked batch, leaves params and optimizer state unchanged and increments
`state.skipped`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from bat_jax import registry, sharding
from bat_jax.grpo.loss import finalize_stats, merge_stats, safe_divide
from bat_jax.train.guarded_adamw import guarded_adamw

Array = jax.Array
Batch = Mapping[str, Array]
RematPolicy = Optional[Callable[..., bool]]
LossFn = Callable[[nnx.Module, Batch, Optional[nnx.Module], RematPolicy],
                  tuple[Array, Array, dict[str, Array]]]

# ---------------------------------------------------------------------------------------------
# Optimizer: AdamW + global-norm clipping + warmup then cosine/constant.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW hyperparameters; `schedule` is a key of `SCHEDULES`."""
  learning_rate: float = 1e-6
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: int = 1
  end_lr_ratio: float = 0.0      # cosine decays to learning_rate * end_lr_ratio
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: Optional[float] = 1.0


def _constant_after_warmup(cfg: OptimizerConfig) -> optax.Schedule:
  return optax.constant_schedule(cfg.learning_rate)


def _cosine_after_warmup(cfg: OptimizerConfig) -> optax.Schedule:
  return optax.cosine_decay_schedule(cfg.learning_rate,
                                     max(cfg.total_steps - cfg.warmup_steps, 1),
                                     alpha=cfg.end_lr_ratio)


SCHEDULES: Mapping[str, Callable[[OptimizerConfig], optax.Schedule]] = {
    "constant": _constant_after_warmup,
    "cosine": _cosine_after_warmup,
}


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """Linear warmup from 0 over `warmup_steps`, then the named schedule."""
  registry.check_registered("schedule", cfg.schedule, SCHEDULES)
  if cfg.warmup_steps < 0 or cfg.total_steps < 1:
    raise ValueError(f"warmup_steps ({cfg.warmup_steps}) must be >= 0 and total_steps "
                     f"({cfg.total_steps}) >= 1")
  after = SCHEDULES[cfg.schedule](cfg)
  if cfg.warmup_steps == 0:
    return after
  warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """Global-norm clipping (when `max_grad_norm` is set) followed by AdamW."""
  adamw = optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay)
  if cfg.max_grad_norm is None:
    return adamw
  if cfg.max_grad_norm <= 0:
    raise ValueError(f"max_grad_norm must be > 0 or None, got {cfg.max_grad_norm}")
  return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)

# ---------------------------------------------------------------------------------------------
# State.
# ---------------------------------------------------------------------------------------------


@flax.struct.dataclass
class TrainState:
  """Everything a step updates.

  Attributes:
    step: int32 scalar, number of steps taken (skipped ones included: the data moved on).
    params: the model's `nnx.Param` state.
    opt_state: optax state for `params`.
    rng: `[2]` uint32 raw PRNG key, advanced every step.
    skipped: int32 scalar, updates skipped by the finite guard.
  """
  step: Array
  params: Any
  opt_state: Any
  rng: Array
  skipped: Array


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, Any, Any]:
  """`(graphdef, params, rest)`: params are the `nnx.Param` leaves, rest every other variable."""
  return nnx.split(model, nnx.Param, ...)


def init_train_state(params: Any, optimizer: optax.GradientTransformation, *,
                     seed: int) -> TrainState:
  """A fresh state at step 0 for `params`."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params),
                    rng=jax.random.key_data(jax.random.PRNGKey(seed)),
                    skipped=jnp.zeros((), jnp.int32))

# ---------------------------------------------------------------------------------------------
# Remat.
# ---------------------------------------------------------------------------------------------

REMAT_POLICIES: Mapping[str, Optional[Callable[..., Any]]] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static step options.

  Attributes:
    num_micro_batches: the batch is scanned in this many equal micro-batches.
    remat_policy: key of `REMAT_POLICIES`; each decoder layer of the policy forward is
      rematerialised with it (`model.hidden_states(..., remat_policy=...)`), so between a
      layer's forward and backward only what the policy saves stays live.
    weight_dtype: dtype the floating params are cast to before the forward (None: used as
      stored). The cast happens on each device's shard, so FSDP all-gathers move bf16 while
      the optimizer keeps fp32 master weights; gradients come back in the stored dtype.
  """
  num_micro_batches: int = 1
  remat_policy: str = "none"
  weight_dtype: Optional[str] = None

  def __post_init__(self):
    registry.check_registered("remat_policy", self.remat_policy, REMAT_POLICIES)
    if self.weight_dtype is not None:
      jnp.dtype(self.weight_dtype)  # raises TypeError naming an unknown dtype
    if self.num_micro_batches < 1:
      raise ValueError(f"num_micro_batches must be >= 1, got {self.num_micro_batches}")

# ---------------------------------------------------------------------------------------------
# The step.
# ---------------------------------------------------------------------------------------------


def split_micro_batches(batch: Batch, num_micro_batches: int) -> dict[str, Array]:
  """`[B, ...]` -> `[M, B/M, ...]`, micro-batch m taking rows m, m+M, m+2M, ...

  The strided split keeps every device's shard local when B is sharded in contiguous blocks
  (each block contributes equally to every micro-batch), so no data moves between devices.
  """
  sizes = {k: v.shape[0] for k, v in batch.items()}
  size = next(iter(sizes.values()))
  if any(s != size for s in sizes.values()):
    raise ValueError(f"batch arrays disagree on the batch dimension: {sizes}")
  if size % num_micro_batches:
    raise ValueError(f"batch size {size} is not divisible by num_micro_batches={num_micro_batches}")
  return {k: v.reshape(size // num_micro_batches, num_micro_batches, *v.shape[1:]).swapaxes(0, 1)
          for k, v in batch.items()}


def merge_micro_batches(x: Array) -> Array:
  """Inverse of `split_micro_batches` for one array: `[M, B/M, ...]` -> `[B, ...]`."""
  return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def cast_floating(tree: Any, dtype: Optional[str]) -> Any:
  """Floating leaves of `tree` cast to `dtype` (no-op for None); ints and keys untouched."""
  if dtype is None:
    return tree
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _all_finite(tree) -> Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _zero_stats(stats: Mapping[str, Any]) -> dict[str, Array]:
  """The identity of `merge_stats` for stats shaped like `stats` (maxima start at -inf)."""
  return {k: jnp.full(v.shape, -jnp.inf if k.endswith("_max") else 0.0, v.dtype)
          for k, v in stats.items()}


def _accumulate(grad_fn, objective, params, batch: Batch, frozen: Mapping[str, Any],
                num_micro_batches: int) -> tuple[Any, Array, Array, dict[str, Array]]:
  """Summed fp32 grads, numerator, denominator and merged stats over the micro-batches."""
  micro = split_micro_batches(batch, num_micro_batches)
  first = jax.tree.map(lambda x: x[0], micro)
  if num_micro_batches == 1:  # no scan: its carry would add the grads to zeros
    (numerator, (denominator, stats)), grads = grad_fn(params, first, frozen)
    return jax.tree.map(lambda g: g.astype(jnp.float32), grads), numerator, denominator, stats
  _, (_, stats_shape) = jax.eval_shape(objective, params, first, frozen)
  zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

  def body(carry, mb):
    grads, numerator, denominator, stats = carry
    (num, (den, st)), g = grad_fn(params, mb, frozen)
    grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
    return (grads, numerator + num, denominator + den, merge_stats(stats, st)), None

  init = (zero_grads, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
          _zero_stats(stats_shape))
  return jax.lax.scan(body, init, micro)[0]


def build_step_fn(graphdef: nnx.GraphDef, loss_fn: LossFn, optimizer: optax.GradientTransformation,
                  cfg: StepConfig = StepConfig(), *,
                  optimizer_cfg: Optional[OptimizerConfig] = None
                  ) -> Callable[..., tuple[TrainState, dict]]:
  """The pure (un-jitted) step `(state, batch, frozen) -> (state, metrics)`.

  `optimizer_cfg`: the config `optimizer` was made from (`make_optimizer`); given, the update
  runs as `guarded_adamw` (the finite guard inside AdamW, so XLA copies no moment), else as
  `optimizer.update` with its result guarded afterwards (any optax transformation).

  `frozen` is `{"rest": non-param model state, "ref_params": reference params or None}`.
  Metrics: `loss`, `loss_denominator`, `grad_norm` (before clipping), `update_applied` (0/1),
  `skipped` (total), plus the objective's stats merged over micro-batches and finalized
  (`x_sum` -> per-token mean `x`).
  """
  policy = REMAT_POLICIES[cfg.remat_policy]
  guarded = None
  if optimizer_cfg is not None:
    guarded = guarded_adamw(optimizer_cfg, make_schedule(optimizer_cfg))

  def objective(params, micro, frozen):
    model = nnx.merge(graphdef, cast_floating(params, cfg.weight_dtype), frozen["rest"])
    ref_model = None
    if frozen["ref_params"] is not None:
      ref_model = nnx.merge(graphdef, frozen["ref_params"], frozen["rest"])
    numerator, denominator, stats = loss_fn(model, micro, ref_model, policy)
    return numerator, (denominator, stats)

  grad_fn = jax.value_and_grad(objective, has_aux=True)

  def step(state: TrainState, batch: Batch, frozen: Mapping[str, Any]):
    grads, numerator, denominator, stats = _accumulate(grad_fn, objective, state.params, batch,
                                                       frozen, cfg.num_micro_batches)
    safe_den = jnp.where(denominator > 0, denominator, 1.0)
    grads = jax.tree.map(lambda g, p: (g / safe_den).astype(p.dtype), grads, state.params)
    loss = safe_divide(numerator, denominator)
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & _all_finite(grads) & (denominator > 0)

    if guarded is not None:
      new_params, new_opt_state = guarded(grads, state.opt_state, state.params, ok)
    else:
      updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
      new_params = keep(optax.apply_updates(state.params, updates), state.params)
      new_opt_state = keep(new_opt_state, state.opt_state)
    new_state = state.replace(
        step=state.step + 1,
        params=new_params,
        opt_state=new_opt_state,
        rng=jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1)),
        skipped=state.skipped + (~ok).astype(jnp.int32))
    metrics = {"loss": loss, "loss_denominator": denominator, "grad_norm": grad_norm,
               "update_applied": ok.astype(jnp.int32), "skipped": new_state.skipped,
               **finalize_stats(stats)}
    return new_state, metrics

  return step


@dataclasses.dataclass(frozen=True)
class StepShardings:
  """Explicit in/out shardings of the step (None leaves mean "let jit choose")."""
  state: Any
  batch: Mapping[str, Any]
  frozen: Any
  metrics: Any


def train_state_shardings(state: TrainState, param_shardings: Any,
                          optimizer: optax.GradientTransformation, replicated: Any) -> TrainState:
  """Shardings for a `TrainState`: optimizer moments follow their params, scalars replicate.

  Args:
    state: the (possibly abstract) state.
    param_shardings: pytree of `NamedSharding` matching `state.params` (e.g. from
      `bat_jax.sharding.model_shardings`).
    optimizer: the transformation that built `state.opt_state`.
    replicated: the replicated sharding of the mesh.
  """
  opt_shardings = optax.tree_map_params(
      optimizer, lambda _, s: s, state.opt_state, param_shardings,
      transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings,
                    rng=replicated, skipped=replicated)


def step_shardings(state: TrainState, batch: Batch, frozen: Mapping[str, Any],
                   optimizer: optax.GradientTransformation, mesh: Mesh,
                   rules: sharding.Rules = sharding.DEFAULT_RULES) -> StepShardings:
  """Shardings of the step's arguments on `mesh`, from the params' logical axes and `rules`.

  Params (and the reference copy) follow their logical axes, optimizer moments their params,
  batch arrays are split over ("data", "fsdp") on the leading dim, scalars and metrics replicate.
  """
  param_shardings = sharding.model_shardings(state.params, mesh, rules)
  repl = sharding.replicated(mesh)
  frozen_shardings = {
      "rest": sharding.model_shardings(frozen["rest"], mesh, rules),
      "ref_params": None if frozen["ref_params"] is None else param_shardings,
  }
  return StepShardings(
      state=train_state_shardings(state, param_shardings, optimizer, repl),
      batch={k: sharding.batch_sharding(mesh, v.ndim) for k, v in batch.items()},
      frozen=frozen_shardings, metrics=repl)


def make_train_step(step_fn: Callable[..., tuple[TrainState, dict]],
                    shardings: Optional[StepShardings] = None, *, donate: bool = True):
  """`jax.jit` of `step_fn` with explicit shardings (when given) and the state donated."""
  donate_argnums = (0,) if donate else ()
  if shardings is None:
    return jax.jit(step_fn, donate_argnums=donate_argnums)
  return jax.jit(step_fn,
                 in_shardings=(shardings.state, dict(shardings.batch), shardings.frozen),
                 out_shardings=(shardings.state, shardings.metrics),
                 donate_argnums=donate_argnums)


def memory_report(compiled) -> dict[str, int]:
  """Bytes per category from XLA's memory analysis of a compiled step ({} when unavailable)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
  return {f: int(getattr(analysis, f)) for f in fields}

