"""The one trainer behind SFT and GRPO (tunix: the RL trainer is the SFT trainer plus a batch
source; MaxText: `jit_train_step` with explicit shardings, AOT-compiled once per shape).

`Trainer` owns everything that is not the objective or the data:

- the layout: param NamedShardings from their logical axes, optimizer moments following their
  params, batches split over ("data", "fsdp");
- state creation straight into that layout: params from an abstract model (`nnx.eval_shape`) are
  created by `jit(init, out_shardings=...)`, AdamW moments by a jitted `optimizer.init` with
  `out_shardings`, and a resume restores orbax arrays directly into the target shardings, so no
  full copy of a leaf ever sits on one device;
- AOT compilation (`.lower().compile()`) once per (program, shapes), traced under the model's
  activation-sharding context (batch over data x fsdp at layer boundaries), with XLA's memory
  analysis of that same executable logged and kept in `memory` (no second compile to measure);
- forward-only logprob passes (old policy, reference) on the step's micro-batches and shardings;
- the resume loop and the checkpoint cadence (`fit`).

SFT (`bat_jax.sft`) and GRPO (`bat_jax.bicurl.grpo_round`) supply a `LossFn` and a `BatchSource`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, Optional, Protocol

import jax
from flax import nnx

from bat_jax import sharding
from bat_jax.train import placement
from bat_jax.train.logprob_pass import LogprobPassConfig, build_logprob_fn, pass_inputs
from bat_jax.train.step import (Batch, LossFn, OptimizerConfig, StepConfig, TrainState,
                                build_step_fn, cast_floating, init_train_state, make_optimizer,
                                memory_report, train_state_shardings)

if TYPE_CHECKING:  # orbax is imported by `fit` only: a step alone needs none (GPU check)
  from bat_jax.checkpointing import Checkpointer, JsonLike

log = logging.getLogger(__name__)

# Compiled programs shared by every Trainer of the process (a GRPO round does not recompile what
# the previous round compiled), keyed by the trainer's `cache_key`, the program and arg shapes.
_COMPILED: dict[tuple, Any] = {}


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """Optimizer, step and checkpoint options of one training run."""
  optimizer: OptimizerConfig
  step: StepConfig = StepConfig()
  seed: int = 0
  checkpoint_every: int = 10
  keep_checkpoints: int = 3

  def __post_init__(self):
    for name in ("checkpoint_every", "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ValueError(f"TrainerConfig.{name} must be >= 1, got {getattr(self, name)}")


class BatchSource(Protocol):
  """What a training run supplies besides its loss (SFT: a grain iterator; GRPO: rollouts)."""

  def next_batch(self, trainer: "Trainer", state: TrainState) -> Optional[Batch]:
    """The next batch, or None to advance the step without an update (the data moved on)."""

  def record(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """Turns the step's metrics into the record passed to `on_step` (may raise to stop)."""

  def get_state(self) -> Any:
    """The data position (saved as the checkpoint's `data` item)."""

  def outer_state(self) -> JsonLike:
    """JSON saved beside the train state (e.g. the step log)."""

  def restore(self, data_state: Any, outer_state: JsonLike) -> None:
    """Continues from a checkpoint's `data` and `outer` items."""


def _shape_key(tree: Any) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return (treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))


class Trainer:
  """Sharded state, compiled programs and the resume loop for one (model, loss, optimizer).

  Args:
    graphdef: the model graph (`split_model(model)[0]`).
    abstract_params: `nnx.Param` state of ShapeDtypeStructs (or arrays; only shapes are read).
    rest: the model's non-param variables (placed replicated / per their logical axes).
    loss_fn: the objective (`bat_jax.train.step.LossFn`).
    cfg: optimizer, step and checkpoint options.
    mesh, rules: the device mesh and logical-axis rules.
    cache_key: hashable identity of (graph, loss, optimizer, step options) under which compiled
      programs are shared across Trainers of the process; None: private to this Trainer.
    compiler_options: XLA debug options for every compile (`Lowered.compile(compiler_options=)`);
      the memory plan turns off LLVM optimisation, which leaves buffers and figures unchanged.
  """

  def __init__(self, graphdef: nnx.GraphDef, abstract_params: Any, rest: Any, loss_fn: LossFn,
               cfg: TrainerConfig, mesh: jax.sharding.Mesh, rules: sharding.Rules, *,
               cache_key: Optional[Hashable] = None,
               compiler_options: Optional[Mapping[str, Any]] = None):
    self.graphdef, self.cfg, self.mesh, self.rules = graphdef, cfg, mesh, tuple(rules)
    self.compiler_options = dict(compiler_options or {})
    # Programs compiled with other options are other executables: never shared.
    self.cache_key = (("trainer", id(self)) if cache_key is None else cache_key,
                      tuple(sorted(self.compiler_options.items())))
    self.optimizer = make_optimizer(cfg.optimizer)
    self.step_fn = build_step_fn(graphdef, loss_fn, self.optimizer, cfg.step,
                                 optimizer_cfg=cfg.optimizer)
    abstract_params = jax.eval_shape(lambda p: p, abstract_params)
    self.param_shardings = sharding.model_shardings(abstract_params, mesh, self.rules)
    self.replicated = sharding.replicated(mesh)
    self.abstract_state = jax.eval_shape(
        lambda p: init_train_state(p, self.optimizer, seed=cfg.seed), abstract_params)
    self.state_shardings = train_state_shardings(self.abstract_state, self.param_shardings,
                                                 self.optimizer, self.replicated)
    rest_shardings = sharding.model_shardings(rest, mesh, self.rules)
    is_abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(rest))
    self.rest = rest if is_abstract else placement.place(rest, rest_shardings)
    self.frozen = {"rest": self.rest, "ref_params": None}
    self.frozen_shardings = {"rest": rest_shardings, "ref_params": None}
    self.memory: dict[str, dict[str, int]] = {}  # program name -> XLA memory analysis

  @classmethod
  def for_model(cls, model: nnx.Module, loss_fn: LossFn, cfg: TrainerConfig,
                mesh: jax.sharding.Mesh, rules: sharding.Rules, **kw) -> "Trainer":
    """A Trainer for `model` (concrete or from `nnx.eval_shape`)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return cls(graphdef, params, rest, loss_fn, cfg, mesh, rules, **kw)

  # -- state ---------------------------------------------------------------------------------

  def place(self, params: Any) -> Any:
    """`params` (every process holds them in full) on their NamedShardings (no copy for leaves
    already there); multi-host, each process builds its own shards (`placement.place`)."""
    return placement.place(params, self.param_shardings)

  def place_batch(self, batch: Batch) -> Batch:
    """A batch every process holds in full (e.g. SFT's, from the same grain seed) on the batch
    shardings; a batch of per-process rows goes through `placement.global_batch` instead."""
    return placement.place(dict(batch), self.batch_shardings(batch))

  def init_params(self, build: Callable[[], nnx.Module]) -> Any:
    """Params of `build()` (e.g. `lambda: build_model(cfg, rngs=nnx.Rngs(seed))`) created
    directly on their shards by `jit(..., out_shardings=...)`."""
    make = lambda: nnx.split(build(), nnx.Param, ...)[1]
    return jax.jit(make, out_shardings=self.param_shardings)()

  def init_state(self, params: Any) -> TrainState:
    """Step-0 state; AdamW moments are created under jit directly into their shardings."""
    init = jax.jit(lambda p: init_train_state(p, self.optimizer, seed=self.cfg.seed),
                   in_shardings=(self.param_shardings,), out_shardings=self.state_shardings,
                   donate_argnums=0)
    return init(self.place(params))

  def state_target(self) -> TrainState:
    """ShapeDtypeStructs carrying the target shardings: what a restore fills in."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        self.abstract_state, self.state_shardings)

  def restore_or_init(self, ckpt: Checkpointer, make_params: Callable[[], Any]):
    """`(state, restored or None)`: the latest checkpoint restored into the target shardings,
    else a fresh state from `make_params()` (never called on resume)."""
    if ckpt.latest_step() is None:
      return self.init_state(make_params()), None
    restored = ckpt.restore(self.state_target())
    return restored.state, restored

  def reference_params(self, params: Any, dtype: Optional[str], *, copy: bool = False) -> Any:
    """A frozen copy of `params` cast to `dtype` on the same shardings (bf16 halves it).
    Params already in `dtype` (the loop's bf16 SFT reference) are placed, not copied, unless
    `copy`: params the train state will be built from must be copied, since every step
    donates the state's buffers (a shared buffer is deleted by the first update)."""
    floats = [x.dtype for x in jax.tree.leaves(params) if jax.numpy.issubdtype(x.dtype,
                                                                                jax.numpy.floating)]
    if dtype is None or all(d == jax.numpy.dtype(dtype) for d in floats):
      placed = self.place(params)
      return jax.tree.map(jax.numpy.copy, placed) if copy else placed
    cast = jax.jit(lambda p: cast_floating(p, dtype), in_shardings=(self.param_shardings,),
                   out_shardings=self.param_shardings)
    return cast(self.place(params))

  # -- compiled programs ---------------------------------------------------------------------

  def _compile(self, name: str, key: tuple, lower: Callable[[], Any]):
    full_key = (self.cache_key, name, key)
    if full_key not in _COMPILED:
      compiled = lower().compile(compiler_options=self.compiler_options or None)
      _COMPILED[full_key] = (compiled, memory_report(compiled))
    compiled, report = _COMPILED[full_key]
    if name not in self.memory or self.memory[name] != report:
      self.memory[name] = report
      log.info("%s memory (MiB): %s", name, {k: round(v / 2**20, 1) for k, v in report.items()})
    return compiled

  def batch_shardings(self, batch: Batch) -> dict[str, Any]:
    return {k: sharding.batch_sharding(self.mesh, len(v.shape)) for k, v in batch.items()}

  def lower_step(self, batch: Batch) -> jax.stages.Lowered:
    """The donated step traced and lowered for this batch's shapes (not compiled)."""
    in_shardings = (self.state_shardings, self.batch_shardings(batch), self.frozen_shardings)
    jitted = jax.jit(self.step_fn, in_shardings=in_shardings,
                     out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
    # The model's activation constraints read the mesh and rules while it is traced.
    with sharding.activation_sharding(self.mesh, self.rules):
      return jitted.lower(self.abstract_state, batch, self.frozen)

  def compiled_step(self, batch: Batch):
    """The AOT-compiled, donated step for this batch's shapes (compiled once per shape)."""
    name = f"step{tuple(batch['input_ids'].shape)}"
    return self._compile(name, _shape_key(batch), lambda: self.lower_step(batch))

  def compiled_logprobs(self, params: Any, inputs: Batch, cfg: LogprobPassConfig, name: str):
    """The AOT-compiled logprob pass for these params' dtypes and the inputs' shapes."""
    in_shardings = (self.param_shardings, self.frozen_shardings["rest"],
                    self.batch_shardings(inputs))
    jitted = jax.jit(build_logprob_fn(self.graphdef, cfg), in_shardings=in_shardings,
                     out_shardings=sharding.batch_sharding(self.mesh, 2))
    abstract = jax.eval_shape(lambda p: p, params)

    def lower():
      with sharding.activation_sharding(self.mesh, self.rules):
        return jitted.lower(abstract, self.rest, inputs)

    return self._compile(f"{name}{tuple(inputs['input_ids'].shape)}",
                         (cfg, _shape_key(abstract), _shape_key(inputs)), lower)

  def logprobs(self, params: Any, batch: Batch, cfg: LogprobPassConfig,
               name: str = "logprobs") -> jax.Array:
    """Taken-token logprobs `[B, T]` of `params` on `batch` (its input keys only)."""
    inputs = pass_inputs(batch)
    return self.compiled_logprobs(params, inputs, cfg, name)(params, self.rest, inputs)

  def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
    """One update (state donated)."""
    return self.compiled_step(batch)(state, batch, self.frozen)

  # -- the loop ------------------------------------------------------------------------------

  def fit(self, checkpoint_dir: str | Path, num_steps: int, source: BatchSource,
          make_params: Callable[[], Any],
          on_step: Optional[Callable[[int, dict[str, Any]], None]] = None) -> TrainState:
    """Runs to `num_steps`, resuming from the latest checkpoint under `checkpoint_dir`.

    A checkpoint (state, `source.get_state()`, `source.outer_state()`) is saved every
    `cfg.checkpoint_every` steps and at the end; a run killed at any point and restarted with the
    same arguments ends bit-identical to an uninterrupted one (same programs, same data order).
    """
    from bat_jax.checkpointing import Checkpointer  # see the imports
    cfg = self.cfg
    with Checkpointer(checkpoint_dir, max_to_keep=cfg.keep_checkpoints) as ckpt:
      state, restored = self.restore_or_init(ckpt, make_params)
      if restored is not None:
        source.restore(restored.data_state, restored.outer_state)
        log.info("resumed %s at step %d", checkpoint_dir, restored.step)
      step = int(state.step)
      while step < num_steps:
        batch = source.next_batch(self, state)
        if batch is None:
          state, metrics = state.replace(step=state.step + 1), {}
        else:
          state, metrics = self.step(state, batch)
        step = int(state.step)
        record = source.record(step, metrics)
        if on_step is not None:
          on_step(step, record)
        if step % cfg.checkpoint_every == 0 or step == num_steps:
          ckpt.save(step, state, data_state=source.get_state(),
                    outer_state=source.outer_state())
    return state
