r"""Per-device memory plan of a config: `python -m bat_jax.memory_plan --config=configs/bat9b.py`.

AOT-compiles the real programs of a run (the SFT step, the old-policy logprob pass, the reference
logprob pass and the GRPO step, through the same `bat_jax.train.Trainer` code a run uses) at the
config's full shapes (full width and depth, the real global batch, the longest sequence the config
allows) on fake CPU devices shaped like the config's mesh, with abstract params (nothing is
allocated). From the compiled programs' memory analysis and the state's shardings it prints, per
device: the state (params, AdamW moments, reference, gradients, export cast), each program's temp
and what it adds beyond the state it reads, and the loop's per-phase, per-component table
(`bat_jax.memory_phases`: SFT, evaluation/export, rollout, GRPO step; resident policy copies,
export casts, framework contexts, the rollout server's share as SGLang sizes it from the memory
free at its start, the rollout model's full size), with the headroom each phase leaves and
`fits`. Exits 1 when something does not fit, 2 when a batch does not split over the mesh
(`--hosts=N` plans N hosts of the config's mesh). `--json=PATH` writes the same numbers. The
programs compile `--compile_workers` at a time (default: the usable CPUs) without LLVM
optimisation (`PLAN_COMPILER_OPTIONS`), which changes the wall time, never the bytes.

Model shapes come from `model.path/config.json` when it exists, else from the published Qwen3.5
text configs below (keyed by the checkpoint directory's name), else `model.hf_config` (scratch).
The CPU compile is the plan's basis; GPU fusion differs, so keep headroom (see README).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from absl import app, flags
from ml_collections import config_flags



@dataclasses.dataclass(frozen=True)
class PlanFlags:
  """The command's flag holders (defined only by an entry point, so importing this module
  defines no absl flags: `launch.py` defines `--config` too)."""
  config: Any
  json: Any
  num_layers: Any
  compile_workers: Any
  hosts: Any


def define_flags() -> PlanFlags:
  held = PlanFlags(
      config=config_flags.DEFINE_config_file("config", None,
                                             "run config file (configs/*.py[:arg])",
                                             lock_config=True),
      json=flags.DEFINE_string("json", None, "write the plan as JSON here"),
      num_layers=flags.DEFINE_integer("num_layers", None,
                                      "plan a shallower model (measurements only)"),
      compile_workers=flags.DEFINE_integer("compile_workers", None,
                                           "programs compiled at once (default: usable CPUs)"),
      hosts=flags.DEFINE_integer("hosts", None, "plan this many hosts of the config's mesh "
                                 "(default: distributed.num_processes, else 1)"))
  flags.mark_flags_as_required(["config"])
  return held

GIB = 2**30
# The plan reads XLA's buffer assignment, which is fixed before LLVM sees the program, so LLVM's
# optimisation of the machine code is skipped: ~35% of a compile's CPU time, the same bytes
# (tests/test_memory_plan.py compares every program's memory analysis with and without).
PLAN_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
# Published Qwen3.5 text configs (HF config.json `text_config`), used when the checkpoint itself
# is not on this machine. Every 4th layer is full attention (HF's full_attention_interval).
PUBLISHED_TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3.5-9B": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096,
                       intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, partial_rotary_factor=0.25, rope_theta=1e7,
                       tie_word_embeddings=False, max_position_embeddings=262144),
    "Qwen3.5-4B": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=2560,
                       intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, partial_rotary_factor=0.25, rope_theta=1e7,
                       tie_word_embeddings=True, max_position_embeddings=262144),
}


def plan_devices(cfg, hosts: int = 1) -> int:
  """Devices of the planned mesh: `hosts` hosts' worth (`data=-1` spans the hosts: data =
  hosts; a given `data` counts every host's devices)."""
  per_host = math.prod(s if s > 0 else 1 for s in (cfg.mesh.fsdp, cfg.mesh.tensor))
  return per_host * (cfg.mesh.data if cfg.mesh.data > 0 else hosts)


def _fake_devices(n: int) -> None:
  """Fake CPU devices; must run before jax initialises a backend."""
  flag = f"--xla_force_host_platform_device_count={n}"
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(kept + [flag])
  os.environ["JAX_PLATFORMS"] = "cpu"


def model_config(cfg, num_layers: Optional[int] = None, attention_impl: str = "chunked"):
  """The policy's `ModelConfig` (see the module docstring for where shapes come from), with
  `attention_impl` (the plan's fake CPU devices compile no GPU-only kernel: "chunked")."""
  from bat_jax.config_validation import FROM_HF_CONFIG
  from bat_jax.model import ModelConfig
  dtype, param_dtype = cfg.model.dtype, cfg.model.param_dtype
  if cfg.model.source in FROM_HF_CONFIG:
    hf = cfg.model.hf_config.to_dict()
  elif cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
    hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
  elif cfg.model.path and Path(cfg.model.path).name in PUBLISHED_TEXT_CONFIGS:
    hf = PUBLISHED_TEXT_CONFIGS[Path(cfg.model.path).name]
  else:
    raise FileNotFoundError(f"config.model.path={cfg.model.path!r} has no config.json and is not "
                            f"one of the published shapes {sorted(PUBLISHED_TEXT_CONFIGS)}")
  model_cfg = ModelConfig.from_hf_dict(hf, dtype=dtype, param_dtype=param_dtype)
  model_cfg = model_cfg.replace(attention_impl=attention_impl)
  if num_layers is not None:
    model_cfg = model_cfg.replace(num_hidden_layers=num_layers,
                                  layer_types=model_cfg.layer_types[:num_layers])
  return model_cfg


def trajectory_len(cfg) -> int:
  """The longest GRPO sequence the config allows (the rollout's context cap)."""
  return cfg.rollout.limits.max_context_tokens or cfg.rollout.jax.max_len


def shard_bytes(tree: Any, shardings: Any) -> int:
  """Bytes of `tree` (ShapeDtypeStructs) on one device under `shardings` (the largest shard)."""
  import jax
  import numpy as np
  total = 0
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    total += int(np.prod(s.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
  return total


def _program(report: dict[str, int], resident_args: int, donated: bool) -> dict[str, int]:
  """One compiled program: its temp, its arguments and outputs (donated state counted once),
  and `extra`, what it adds to the device beyond the `resident_args` bytes of state it reads."""
  io = report["argument_size_in_bytes"] + report["output_size_in_bytes"]
  if donated:
    io -= report["alias_size_in_bytes"]
  return {"temp": report["temp_size_in_bytes"], "io": io,
          "extra": max(io + report["temp_size_in_bytes"] - resident_args, 0)}


def _batch(shapes: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, Any]:
  import jax
  return {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in shapes.items()}


def compile_concurrently(jobs: dict[str, Callable[[], Any]], workers: int) -> dict[str, float]:
  """Runs the compile `jobs` (name -> thunk), `workers` at a time; returns each one's wall
  seconds. Tracing holds the GIL but XLA's compile releases it, so on several cores one
  program's compile overlaps the others' (tracing state is thread-local in JAX and nnx)."""

  def timed(job):
    start = time.monotonic()
    job()
    return round(time.monotonic() - start, 1)

  with concurrent.futures.ThreadPoolExecutor(max_workers=max(workers, 1),
                                             thread_name_prefix="plan-compile") as pool:
    futures = {name: pool.submit(timed, job) for name, job in jobs.items()}
    return {name: future.result() for name, future in futures.items()}


def _compile_programs(cfg, abstract, mesh, shapes: dict[str, tuple[int, int]], workers: int):
  """AOT-compiles the GRPO step, the SFT step and the logprob passes (abstract arguments).
  Returns (SFT trainer, GRPO trainer, abstract reference params, compile seconds)."""
  import jax
  from bat_jax.run_programs import (grpo_config, grpo_trainer, logprob_pass_config,
                                    optimizer_config, step_config)
  from bat_jax.sft import sft_loss_fn
  from bat_jax.train import Trainer, TrainerConfig, cast_floating

  (b_sft, t_sft), (b_rl, t_rl) = shapes["sft"], shapes["grpo"]
  sft = Trainer.for_model(abstract, sft_loss_fn(chunk_size=cfg.grpo.logprob_chunk_size),
                          TrainerConfig(optimizer_config(cfg.sft, cfg.sft.steps),
                                        step_config(cfg.sft, cfg.trainer)), mesh,
                          tuple(cfg.sharding.rules), compiler_options=PLAN_COMPILER_OPTIONS)
  sft_batch = _batch({k: ((b_sft, t_sft), "int32") for k in ("input_ids", "loss_mask", "valid")})
  grpo = grpo_trainer(cfg, abstract, mesh, compiler_options=PLAN_COMPILER_OPTIONS)
  pass_cfg = logprob_pass_config(cfg)
  kl = grpo_config(cfg).kl_coef > 0
  old_pass = cfg.grpo.old_logp == "pass"
  inputs = _batch({"input_ids": ((b_rl, t_rl), "int32"), "valid": ((b_rl, t_rl), "int32")})
  params = grpo.abstract_state.params
  ref = jax.eval_shape(lambda p: cast_floating(p, cfg.trainer.reference_dtype), params)
  rl_batch = _batch({"input_ids": ((b_rl, t_rl), "int32"), "valid": ((b_rl, t_rl), "int32"),
                     "loss_mask": ((b_rl, t_rl), "float32"), "advantages": ((b_rl,), "float32"),
                     **({"old_logp": ((b_rl, t_rl), "float32")} if old_pass else {}),
                     **({"ref_logp": ((b_rl, t_rl), "float32")} if kl else {})})
  # Largest first, so the small passes fill in beside the two steps.
  jobs = {"grpo_step": lambda: grpo.compiled_step(rl_batch),
          "sft_step": lambda: sft.compiled_step(sft_batch)}
  if old_pass:
    jobs["old_logp_pass"] = lambda: grpo.compiled_logprobs(params, inputs, pass_cfg, "old_logp")
  if kl:
    jobs["ref_logp_pass"] = lambda: grpo.compiled_logprobs(ref, inputs, pass_cfg, "ref_logp")
  seconds = compile_concurrently(jobs, workers)
  return sft, grpo, (ref if kl else None), seconds


def plan(cfg, num_layers: Optional[int] = None, workers: int = 1) -> dict[str, Any]:
  """Compiles the run's programs abstractly (`workers` compiles at a time) and returns the
  per-device plan (bytes): state, programs, and the loop's phases (`bat_jax.memory_phases`)."""
  import jax
  from flax import nnx
  from bat_jax import memory_phases
  from bat_jax.run_programs import run_mesh
  from bat_jax.model import build_model
  from bat_jax.train import cast_floating

  mesh = run_mesh(cfg)
  model_cfg = model_config(cfg, num_layers)
  abstract = nnx.eval_shape(lambda: build_model(model_cfg, rngs=nnx.Rngs(0)))
  b_sft, t_sft = cfg.sft.global_batch_size, cfg.sft.max_seq_len
  b_rl, t_rl = cfg.grpo.prompt_groups * cfg.grpo.group_size, trajectory_len(cfg)
  sft, grpo, ref, seconds = _compile_programs(
      cfg, abstract, mesh, {"sft": (b_sft, t_sft), "grpo": (b_rl, t_rl)}, workers)
  state, shardings = grpo.abstract_state, grpo.state_shardings
  params_b = shard_bytes(state.params, shardings.params)
  opt_b = shard_bytes(state.opt_state, shardings.opt_state)
  sft_opt_b = shard_bytes(sft.abstract_state.opt_state, sft.state_shardings.opt_state)
  ref_b = 0 if ref is None else shard_bytes(ref, shardings.params)
  cast = lambda dtype: shard_bytes(
      jax.eval_shape(lambda p: cast_floating(p, dtype), state.params), shardings.params)
  mem = {**sft.memory, **grpo.memory}
  programs = {
      "sft_step": _program(mem[f"step{(b_sft, t_sft)}"], params_b + sft_opt_b, donated=True),
      "grpo_step": _program(mem[f"step{(b_rl, t_rl)}"], params_b + opt_b, donated=True),
  }
  if cfg.grpo.old_logp == "pass":
    programs["old_logp_pass"] = _program(mem[f"old_logp{(b_rl, t_rl)}"], params_b,
                                         donated=False)
  if ref is not None:
    programs["ref_logp_pass"] = _program(mem[f"ref_logp{(b_rl, t_rl)}"], ref_b, donated=False)
  need = rollout_need(cfg, model_cfg, t_rl)
  holdings = memory_phases.Holdings(
      sft_params=params_b, sft_optimizer=sft_opt_b, sft_program=programs["sft_step"]["extra"],
      params=params_b, optimizer=opt_b, reference=ref_b, sft_policy=params_b,
      export_cast=cast(cfg.rollout.sglang.dtype),
      grpo_program=max(p["extra"] for n, p in programs.items() if n != "sft_step"),
      rollout_need=need["rollout_need"])
  table = memory_phases.phase_table(cfg, holdings)
  return {
      "config": {"model_layers": model_cfg.num_hidden_layers, "hidden": model_cfg.hidden_size,
                 "mesh": dict(mesh.shape), "sft_batch": [b_sft, t_sft],
                 "grpo_batch": [b_rl, t_rl], "micro_batches": [cfg.sft.micro_batches,
                                                               cfg.grpo.micro_batches],
                 "weight_dtype": cfg.trainer.weight_dtype,
                 "reference_dtype": cfg.trainer.reference_dtype, "layout": cfg.memory.layout,
                 "seq_tile_size": model_cfg.seq_tile_size},
      "per_device": {"params": params_b, "optimizer": opt_b, "reference": ref_b,
                     "gradients": cast("float32"), "export_cast": holdings.export_cast,
                     "programs": programs,
                     # JAX's largest moment: a program beside the state it reads and the rest
                     # of what stays resident (the measured peak of the GPU check compares here)
                     "peak": max(holdings.sft_params + sft_opt_b + holdings.sft_program,
                                 params_b + opt_b + ref_b + holdings.grpo_program)},
      "rollout": need, "phases": table, "fits": table["all_fit"], "compile_seconds": seconds,
  }


def rollout_need(cfg, model_cfg, context: int) -> dict[str, int]:
  """What one SGLang GPU needs: bf16 weights over its TP group plus the KV (full-attention
  layers) and recurrent state (DeltaNet layers) of its replica's share of the concurrent
  trajectories at full context."""
  from bat_jax.model import build_model
  from flax import nnx
  import jax
  import numpy as np
  abstract = nnx.eval_shape(lambda: build_model(model_cfg, rngs=nnx.Rngs(0)))
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  s = cfg.rollout.sglang
  weights = 2 * n_params // s.tp_size
  full = sum(k == "full_attention" for k in model_cfg.layer_types)
  linear = len(model_cfg.layer_types) - full
  kv_per_token = full * 2 * model_cfg.num_key_value_heads * model_cfg.head_dim * 2 // s.tp_size
  state_per_seq = linear * model_cfg.linear_num_value_heads * (
      model_cfg.linear_key_head_dim * model_cfg.linear_value_head_dim * 4) // s.tp_size
  per_replica = math.ceil(cfg.rollout.max_concurrent_trajectories / s.dp_size)
  need = weights + per_replica * (context * kv_per_token + state_per_seq)
  return {"rollout_weights": weights, "rollout_need": need, "params_count": n_params}


def format_table(result: dict[str, Any]) -> str:
  from bat_jax import memory_phases
  gib = lambda b: f"{b / GIB:.2f}"
  d = result["per_device"]
  lines = [f"memory plan: {result['config']}",
           f"state per device (GiB): params {gib(d['params'])}, AdamW {gib(d['optimizer'])}, "
           f"reference {gib(d['reference'])}, gradients (in the step's temp) "
           f"{gib(d['gradients'])}, export cast {gib(d['export_cast'])}"]
  for name, p in d["programs"].items():
    lines.append(f"  {name:<14} temp {gib(p['temp']):>6}  beyond the state it reads "
                 f"{gib(p['extra']):>6}")
  lines += [memory_phases.format_phase_table(result["phases"]),
            f"compile seconds: {result['compile_seconds']}",
            f"fits: {'true' if result['fits'] else 'false'}"]
  return "\n".join(lines)


def main(argv, held: PlanFlags) -> int:
  del argv
  cfg = held.config.value
  hosts = held.hosts.value or cfg.distributed.num_processes or 1
  devices = plan_devices(cfg, hosts)
  from bat_jax.config_validation import batch_layout_problems
  errors = batch_layout_problems(cfg, hosts)
  if errors:
    print(f"memory plan refused ({hosts} host(s), {devices} devices):\n  " + "\n  ".join(errors),
          file=sys.stderr)
    return 2
  _fake_devices(devices)
  import jax
  if jax.device_count() != devices:
    raise RuntimeError(f"memory_plan needs {devices} fake devices but jax has "
                       f"{jax.device_count()} (a backend was initialised before XLA_FLAGS)")
  workers = held.compile_workers.value or len(os.sched_getaffinity(0))
  result = plan(cfg, held.num_layers.value, workers)
  result["config"]["hosts"] = hosts
  print(format_table(result), flush=True)
  if held.json.value:
    Path(held.json.value).write_text(json.dumps(result, indent=2) + "\n")
  return 0 if result["fits"] else 1


if __name__ == "__main__":
  _HELD = define_flags()
  app.run(lambda argv: sys.exit(main(argv, _HELD)))
