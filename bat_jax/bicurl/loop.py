"""BiCuRL: the outer loop, in one readable function (`run`).

    cold-start SFT (once) -> evaluate -> first target = weakest stage
    for each round:
      Stage Bank round (requested as soon as its weights are known)
      GRPO steps (G rollouts per state_id, rubric rewards, checkpoint every k steps)
      export -> evaluate on the same paired cells -> gate (promote | hold) -> next target
    SFT and the accepted policy on held-back cells (`evaluator.heldback_cells_per_track`)

Resume: every phase writes its result under WORKDIR before the next one starts and
`OuterState` records what is done, so `run(cfg, workdir)` on a killed run's directory
continues at the first unfinished phase (mid-SFT and mid-round from the latest orbax step,
mid-evaluation by re-running that evaluation, which is deterministic).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import ml_collections
import numpy as np
import tqdm
from flax import nnx
from tensorboardX import SummaryWriter

from bat_jax.run_config import RunConfig
from bat_jax import curriculum, gate, sharding
from bat_jax.bicurl import bank as bank_lib
from bat_jax.bicurl import multihost, setup
from bat_jax.bicurl.grpo_round import (GrpoRound, bucket_length, grpo_config, optimizer_config,
                                       run_mesh, step_config)
from bat_jax.bicurl.policy import PolicyServer, evaluate_policy, make_policy_server
from bat_jax.bicurl.report import build_report, headline, write_report
from bat_jax.bicurl.state import (OuterState, RoundRecord, RunPaths, check_same_config,
                                  heldback_name)
from bat_jax.pretrain import base as pretrain_base
from bat_jax.stagebank import leakcheck
from bat_jax.stagebank.build import load_matcher
from bat_jax.stagebank.shards import round_dirname
from bat_jax.checkpointing import export_hf
from bat_jax.evaluator.cells import load_or_create_secret
from bat_jax.model import ModelConfig, build_model, load_pretrained
from bat_jax.model.decoder import with_attention_impl
from bat_jax.sft import SftConfig, pad_example, run_sft, sft_loss_fn
from bat_jax.train import Trainer, cast_floating, placement, split_model
from bat_jax.sandbox import safe_fs
from bat_jax.model.chat_format import ChatFormat

log = logging.getLogger(__name__)


def params_digest(model: nnx.Module) -> str:
  """sha256 over every param's path, dtype, shape and bytes (equal params <=> equal digest)."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
    array = np.asarray(jax.device_get(leaf))
    h.update(f"{jax.tree_util.keystr(path)}|{array.dtype}|{array.shape}|".encode())
    h.update(array.tobytes())
  return h.hexdigest()


class _Tracker:
  """TensorBoard scalars (tensorboardX) and tqdm bars, each switchable in `cfg.logging`."""

  def __init__(self, cfg: RunConfig, paths: RunPaths):
    self.writer = (SummaryWriter(str(paths.tensorboard))
                   if cfg.logging.tensorboard and multihost.is_primary() else None)
    self.progress = cfg.logging.progress
    self.every = cfg.logging.log_every_steps

  def scalars(self, prefix: str, values: dict[str, Any], step: int) -> None:
    if self.writer is None or step % self.every:
      return
    for k, v in values.items():
      if isinstance(v, (int, float)) and v is not None:
        self.writer.add_scalar(f"{prefix}/{k}", v, step)

  def bar(self, total: int, desc: str, initial: int = 0) -> tqdm.tqdm:
    return tqdm.tqdm(total=total, desc=desc, initial=initial, disable=not self.progress,
                     dynamic_ncols=True, leave=False)

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()


def sft_reference(cfg: RunConfig, sft_model: nnx.Module) -> Any:
  """What the rounds keep of the SFT policy: its params cast to `trainer.reference_dtype` on
  their shards when the KL reference is the SFT policy, else None."""
  if grpo_config(cfg).kl_coef <= 0 or cfg.grpo.kl_reference != "sft":
    return None
  cast = jax.jit(lambda p: cast_floating(p, cfg.trainer.reference_dtype))
  return cast(nnx.state(sft_model, nnx.Param))


def _scratch_builder(cfg: RunConfig, seed: int) -> Callable[[], nnx.Module]:
  """`() -> model`: the seeded random init of `model.hf_config`."""
  dtype, param_dtype = setup.model_dtypes(cfg)
  model_cfg = ModelConfig.from_hf_dict(cfg.model.hf_config.to_dict(), dtype=dtype,
                                       param_dtype=param_dtype,
                                       ).replace(attention_impl=cfg.model.attention_impl)
  return lambda: build_model(model_cfg, rngs=nnx.Rngs(seed))


def _initial_policy(cfg: RunConfig, mesh: jax.sharding.Mesh, checkpoint: Optional[Path]
                    ) -> tuple[nnx.Module, Callable[[Trainer], Any]]:
  """`(abstract model, make_params)`: the policy before SFT as shapes only, and how its params
  are created straight onto their shards when there is no checkpoint to resume (a seeded jitted
  init for `scratch`, else `checkpoint` (the tiny base or `model.path`) read tensor by tensor
  onto its shards)."""
  dtype, param_dtype = setup.model_dtypes(cfg)
  rules = tuple(cfg.sharding.rules)
  if checkpoint is None:
    build = _scratch_builder(cfg, cfg.seed)
    return nnx.eval_shape(build), lambda trainer: trainer.init_params(build)
  model_cfg = ModelConfig.from_pretrained_dir(checkpoint, dtype=dtype, param_dtype=param_dtype
                                              ).replace(attention_impl=cfg.model.attention_impl)
  abstract = nnx.eval_shape(lambda: build_model(model_cfg, rngs=nnx.Rngs(0)))
  load = lambda trainer: nnx.state(load_pretrained(checkpoint, dtype=dtype,
                                                   param_dtype=param_dtype, mesh=mesh,
                                                   rules=rules), nnx.Param)
  return abstract, load


def _tiny_base(cfg: RunConfig, paths: RunPaths, tokenizer_dir: Path) -> tuple[Path, dict]:
  """The tiny base's HF folder and record (`bat_jax.pretrain.base`: built once, then cached)."""
  pcfg = pretrain_base.PretrainConfig.from_config(cfg.pretrain)
  checker = leakcheck.LeakChecker(load_matcher(paths.markers))
  cells = json.dumps([dataclasses.asdict(c) for c in cfg.heldout_cells()], sort_keys=True)
  return pretrain_base.ensure_base(_scratch_builder(cfg, pcfg.seed), pcfg,
                                   cfg.model.hf_config.to_dict(), tokenizer_dir, checker,
                                   mesh=run_mesh(cfg), rules=tuple(cfg.sharding.rules),
                                   heldout_key=hashlib.sha256(cells.encode()).hexdigest())


def _niced(fn: Callable[[], Any]) -> Any:
  """`fn()` at nice 10 in this thread alone (Linux nice values are per thread), inherited by the
  threads and sandbox processes it starts: they get the cores the trainer leaves idle."""
  os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
  return fn()


def _rows_beside_pretraining(cfg: RunConfig, paths: RunPaths) -> concurrent.futures.Future:
  """Starts building the cold-start rows now, in a niced thread beside the base's pretraining;
  after it they took ~60 s (run h1). On 2 cores the gain is small and noisy (the base took
  407-462 s with them beside its echo phases, ~390 s alone), and beside the corpus phase or in a
  niced process they cost more than they saved (runs f1, f4; experiments/README.md, "A
  two-step plan")."""
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sft-rows-bg")
  future = pool.submit(_niced, lambda: setup.prepare_sft_rows(cfg, paths.sft_rows,
                                                              paths.markers))
  pool.shutdown(wait=False)
  return future


def _cold_start(cfg: RunConfig, paths: RunPaths, chat_format: ChatFormat,
                tracker: _Tracker, checkpoint: Optional[Path],
                rows_job: Optional[concurrent.futures.Future] = None
                ) -> tuple[nnx.Module, Optional[float]]:
  """Cold-start SFT on the Stage Bank's expert rows from `checkpoint` (None: a random init),
  resumable from its orbax checkpoints; returns the model and its validation NLL. `rows_job`:
  the rows already being built (`_rows_beside_pretraining`), else they are built here."""
  rows_dir = multihost.primary_first(
      "sft_rows", lambda: rows_job.result() if rows_job is not None
      else setup.prepare_sft_rows(cfg, paths.sft_rows, paths.markers))
  train, validation = setup.sft_examples(cfg, rows_dir, chat_format)
  max_len = bucket_length(max(setup.example_lengths(train)), cfg.sft.max_seq_len)
  mesh = run_mesh(cfg)
  model, make_params = _initial_policy(cfg, mesh, checkpoint)
  sft_cfg = SftConfig(
      num_steps=cfg.sft.steps, batch_size=cfg.sft.global_batch_size, max_len=max_len,
      bucket_lengths=tuple(cfg.sft.bucket_lengths), seed=cfg.seed,
      checkpoint_every=cfg.sft.checkpoint.every, keep_checkpoints=cfg.sft.checkpoint.keep,
      logprob_chunk_size=cfg.grpo.logprob_chunk_size,
      context_loss_weight=cfg.sft.context_loss_weight,
      pad_id=chat_format.endoftext_id, optimizer=optimizer_config(cfg.sft, cfg.sft.steps),
      step=step_config(cfg.sft, cfg.trainer))
  log.info("SFT: %d train / %d validation examples, padded to %d tokens (buckets %s)",
           len(train), len(validation), max_len, tuple(cfg.sft.bucket_lengths))
  bar = tracker.bar(cfg.sft.steps, "cold-start SFT")

  def on_step(step: int, metrics: dict[str, Any]) -> None:
    values = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
    if not np.isfinite(values["loss"]):
      raise FloatingPointError(f"SFT step {step}: non-finite loss {values['loss']}")
    tracker.scalars("sft", values, step)
    bar.n = step
    bar.set_postfix(loss=f"{values['loss']:.3f}")

  run_sft(model, train, sft_cfg, paths.sft_checkpoints, mesh=mesh,
          rules=tuple(cfg.sharding.rules), make_params=make_params, on_step=on_step)
  bar.close()  # `model` holds the trained params on their shards (never gathered)
  nll = _validation_nll(model, validation, max_len=max_len, pad_id=chat_format.endoftext_id,
                        chunk_size=cfg.grpo.logprob_chunk_size, mesh=mesh)
  log.info("SFT: validation NLL per target token %s", nll)
  return model, nll


def _validation_nll(model: nnx.Module, examples: list, *, max_len: int, pad_id: int,
                    chunk_size: int, mesh: jax.sharding.Mesh) -> Optional[float]:
  """Mean NLL per target token of held-out SFT examples (None when there are none), with the
  params on their shards of `mesh` and each example replicated over it."""
  if not examples:
    return None
  graphdef, params, rest = split_model(model)
  loss_fn = sft_loss_fn(chunk_size=chunk_size)

  @jax.jit
  def nll(params, batch):
    numerator, denominator, _ = loss_fn(nnx.merge(graphdef, params, rest), batch, None)
    return numerator, denominator

  total = tokens = 0.0
  for ids, mask in examples:
    padded = pad_example(ids, mask, max_len=max_len, pad_id=pad_id)
    batch = placement.place({k: v[None] for k, v in padded.items()},
                            {k: sharding.replicated(mesh) for k in padded})
    numerator, denominator = nll(params, batch)
    total, tokens = total + float(numerator), tokens + float(denominator)
  return total / tokens


def _evaluate(cfg: RunConfig, state: OuterState, paths: RunPaths,
              server: PolicyServer, chat_format: ChatFormat, model: nnx.Module, name: str,
              eval_index: int, tracker: _Tracker, *, heldback: bool = False) -> dict[str, Any]:
  """Serves `model` and evaluates it (cached per policy name); records the headline, logged at
  step `eval_index` (0 = SFT, r + 1 = round r). `heldback`: on the held-back cells instead,
  recorded as `heldback_name(name)`. Multi-host: process 0 evaluates, the others read its
  cached report."""
  record = heldback_name(name) if heldback else name
  if heldback:
    cfg = dataclasses.replace(cfg, evaluation=cfg.evaluation.heldback(
        cfg.evaluator.heldback_cells_per_track))
  with state.timed("evaluation"):
    multihost.barrier(f"evaluate {record}: exported")
    if not paths.eval_report(record).is_file():
      server.load(model, record)  # every process: loading joins collectives over the shards
    if not multihost.is_primary():
      multihost.barrier(f"evaluate {record}: done")
    bar = tracker.bar(0, f"evaluate {record}")

    def progress(done: int, total: int, record: dict) -> None:
      del record
      bar.total, bar.n = total, done
      bar.refresh()

    report = evaluate_policy(cfg, server, chat_format, paths.policy(name),
                             paths.eval_report(record), paths.eval_records(record),
                             progress=progress)
    bar.close()
    if multihost.is_primary():
      multihost.barrier(f"evaluate {record}: done")
  state.evaluations[record] = {**headline(report), "params_sha256": params_digest(model)}
  tracker.scalars("eval_heldback" if heldback else "eval",
                  {"overall": report["overall"], "task": report["task_score"],
                   **{s: v for s, v in report["stage_scores"].items()}}, eval_index)
  log.info("evaluation %s: overall %s, stages %s", record, report["overall"],
           report["stage_scores"])
  return report


def prune_rounds(paths: RunPaths, state: OuterState, keep: int) -> list[int]:
  """Deletes the artifacts of finished rounds older than the last `keep`: their orbax checkpoints
  (~12 bytes per param each) and their candidate exports, except the promoted policy's (the next
  round's start and the gate's baseline). Runs after `state.save`, so a crash in between only
  leaves extra files. Returns the pruned rounds."""
  finished = [r.round for r in state.rounds]
  pruned = finished[:-keep] if keep > 0 else finished
  for r in pruned:
    shutil.rmtree(paths.round_checkpoints(r), ignore_errors=True)
    if round_dirname(r) != state.baseline:
      shutil.rmtree(paths.policy(round_dirname(r)), ignore_errors=True)
  return pruned


def _save(state: OuterState, paths: RunPaths) -> None:
  if multihost.is_primary():  # every process holds the same state; one writes it
    state.save(paths.workdir)


def _report(state: OuterState, paths: RunPaths) -> dict[str, Any]:
  return write_report(paths.workdir, state) if multihost.is_primary() else build_report(state)


def run(config: ml_collections.ConfigDict, workdir: str | Path) -> dict[str, Any]:
  """Runs (or resumes) BiCuRL in `workdir`; returns the final report (also WORKDIR/report.json).

  Raises:
    ConfigError: the config is invalid (every bad field named).
    FloatingPointError: a non-finite SFT or GRPO update.
  """
  cfg = RunConfig.from_config(config)
  paths = RunPaths(Path(workdir).absolute())
  paths.workdir.mkdir(parents=True, exist_ok=True)
  check_same_config(config, paths.workdir / "config.json")
  # The held-out cells are keyed by this run's secret: the same cells for every evaluation of
  # the run (the gate's pairing), also after a restart, and none a sandbox could derive.
  secret = multihost.primary_first("eval secret",
                                   lambda: load_or_create_secret(paths.eval_secret))
  cfg = dataclasses.replace(cfg, evaluation=dataclasses.replace(cfg.evaluation, secret=secret))
  state = OuterState.load(paths.workdir)
  tracker = _Tracker(cfg, paths)
  server: Optional[PolicyServer] = None

  # ============================================================================ setup
  tokenizer_dir = multihost.primary_first(
      "tokenizer", lambda: setup.prepare_tokenizer(cfg, paths.tokenizer))
  chat_format = setup.chat_format(cfg, tokenizer_dir)
  multihost.primary_first("markers", lambda: bank_lib.write_markers(cfg, paths.markers))
  bank_dir = Path(cfg.stagebank.dir) if cfg.stagebank.dir else paths.stagebank
  if multihost.is_primary():  # one Stage Bank; the other processes read its rounds
    bank = bank_lib.StageBank.start(cfg, bank_dir, paths.markers, paths.logs / "stagebank.log")
  else:
    bank = bank_lib.StageBank(bank_dir, None, cfg.stagebank.request_timeout_s)
  try:
    # ========================================================================== tiny base
    start = None if cfg.model.source == "scratch" else Path(cfg.model.path or "")
    rows_job = None
    if cfg.model.source == "tiny_base" and not state.sft_done:
      if multihost.is_primary():
        rows_job = _rows_beside_pretraining(cfg, paths)
      with state.timed("pretrain"):
        start, state.pretrain = _tiny_base(cfg, paths, tokenizer_dir)
      _save(state, paths)

    # ========================================================================== cold-start SFT
    if not state.sft_done:
      with state.timed("sft"):
        model, state.sft_validation_nll = _cold_start(cfg, paths, chat_format, tracker, start,
                                                      rows_job)
      export_hf(model, paths.policy("sft"), tokenizer_dir=tokenizer_dir,
                vision_source=setup.vision_source(cfg))
      del model  # the trained SFT params: the loop reloads the export (no second copy)
      state.sft_done, state.baseline = True, "sft"
      _save(state, paths)
    multihost.barrier("sft exported")
    mesh = run_mesh(cfg)
    sft_model = setup.load_policy(cfg, paths.policy("sft"), mesh)
    server = make_policy_server(sft_model, cfg, paths.workdir, tokenizer_dir)

    # ============================================ evaluate SFT; first target = weakest stage
    baseline_report = _evaluate(cfg, state, paths, server, chat_format, sft_model, "sft",
                                0, tracker)
    if state.next_weights is None:
      state.next_weights = curriculum.weights(
          baseline_report["stage_scores"], None, True, cfg.curriculum,
          reach=curriculum.reach_fractions(baseline_report))
      _save(state, paths)
    if state.baseline != "sft":
      baseline_report = evaluate_policy(cfg, server, chat_format, paths.policy(state.baseline),
                                        paths.eval_report(state.baseline),
                                        paths.eval_records(state.baseline))

    # The fp32 SFT policy is not kept during rounds (issue 25): only the KL reference, cast
    # to `trainer.reference_dtype` once (bf16 at 9B) on the same shards, and only when a round
    # uses it; the gate's baseline is its cached report.
    ref_params = sft_reference(cfg, sft_model)
    del sft_model
    # ========================================================================== BiCuRL rounds
    for r in range(len(state.rounds), cfg.grpo.rounds):
      weights = state.next_weights
      if multihost.is_primary():  # idempotent; normally already sent at the end of round r-1
        bank.request(r, weights)
      with state.timed("stagebank_wait"):
        round_dir = bank.wait(r)

      # ---------------------------------------------------------------- GRPO
      start_name = state.baseline
      model = with_attention_impl(setup.load_policy(cfg, paths.policy(start_name), mesh),
                                  cfg.model.attention_impl)
      workspaces = paths.workdir / "rollouts" / round_dirname(r)
      grpo = GrpoRound(cfg, r, model, ref_params, server, chat_format, paths.round_checkpoints(r),
                       workspaces)
      done_before = sum(len(x.steps) for x in state.rounds)
      bar = tracker.bar(cfg.grpo.steps_per_round, f"round {r} GRPO")

      def on_step(step: int, record: dict[str, float], bar=bar, offset=done_before) -> None:
        tracker.scalars("grpo", record, offset + step)
        bar.n = step
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", kl=f"{record.get('kl', 0):.4f}")

      outcome = grpo.run(round_dir, on_step)
      bar.close()
      safe_fs.remove_tree_quietly(workspaces)  # agent-made trees: deep, odd names

      # ---------------------------------------------------------------- export + evaluate
      name = round_dirname(r)
      export_hf(model, paths.policy(name), tokenizer_dir=tokenizer_dir,
                vision_source=setup.vision_source(cfg))
      candidate_report = _evaluate(cfg, state, paths, server, chat_format, model, name,
                                   r + 1, tracker)

      # ---------------------------------------------------------------- gate + next target
      decision = gate.check(baseline_report, candidate_report, cfg.gate, outcome.healthy)
      next_weights = curriculum.weights(
          candidate_report["stage_scores"], baseline_report["stage_scores"], decision.passed,
          cfg.curriculum, reach=curriculum.reach_fractions(candidate_report))
      if r + 1 < cfg.grpo.rounds and multihost.is_primary():
        bank.request(r + 1, next_weights)  # as early as possible: synthesis overlaps the rest
      state.rounds.append(RoundRecord(
          round=r, target=weights.primary_stage, weights=weights,
          start_policy=start_name, candidate=name, gate=decision.to_dict(),
          promoted=decision.passed, steps=outcome.steps, healthy=outcome.healthy))
      for phase, seconds in outcome.seconds.items():
        state.phase_seconds[phase] += seconds
      state.next_weights = next_weights
      if decision.passed:  # a held candidate is never the next start: the baseline stays
        state.baseline, baseline_report = name, candidate_report
      _save(state, paths)
      if multihost.is_primary():
        prune_rounds(paths, state, cfg.trainer.keep_rounds)
      _report(state, paths)
      log.info("round %d: target %s, gate %s%s", r, state.rounds[-1].target,
               "pass" if decision.passed else "hold",
               "" if decision.passed else f" ({'; '.join(decision.reasons)})")

    # ============================== held-back cells: the accepted policy's score, unselected
    # The gate chose among rounds on the cells above; on cells it never saw, the accepted
    # policy's change over SFT is free of that selection. Nothing to score when none passed.
    if cfg.evaluator.heldback_cells_per_track and state.baseline != "sft":
      for i, name in enumerate(("sft", state.baseline)):
        _evaluate(cfg, state, paths, server, chat_format,
                  setup.load_policy(cfg, paths.policy(name), mesh), name, i, tracker,
                  heldback=True)

    # ============================================================================ report
    _save(state, paths)
    return _report(state, paths)
  finally:
    bank.close()
    if server is not None:
      server.close()
    tracker.close()
