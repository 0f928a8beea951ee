"""The outer loop's policy phases at a given width, measuring where every policy copy lives.

`run_phases` follows the loop's own code, the way `bicurl.loop.run` strings it together: the
initial policy created on its shards (`loop._initial_policy`) and one SFT step (`run_sft`), the
evaluation export (`export_hf`), the SFT policy loaded back (`setup.load_policy`) and, as the
rounds keep of it, only its bf16 KL reference (`loop.sft_reference`; no fp32 SFT policy in the
rounds), a round's start policy, one GRPO step with that reference (`grpo_trainer`), and the rollout
export in bf16 (sharded safetensors + index). After each phase it records, per device, the
bytes of every resident policy copy and of all live arrays. Used by `test_sharded_policy.py`
on 8 fake devices and by `drive_sharded_loop.py` in each of two `jax.distributed` processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from bat_jax import sharding
from bat_jax.bicurl import loop, multihost, setup
from bat_jax.bicurl.grpo_round import (grpo_trainer, logprob_pass_config, optimizer_config,
                                       run_mesh, step_config)
from bat_jax.checkpointing import export_hf
from bat_jax.run_config import RunConfig
from bat_jax.sft import SftConfig, run_sft, sft_trainer
from bat_jax.train import placement
from fast_config import fast_config

L, F = "linear_attention", "full_attention"
# Qwen3.5-9B widths (its published text config): hidden 4096; DeltaNet 16 key heads x 128,
# 32 value heads x 128; attention 16 query / 4 KV heads x 256. Reduced: one DeltaNet + one
# attention layer, intermediate 512 (of 12,288), vocab 1,024 (of 248,320).
NINE_B_WIDTHS = dict(hidden_size=4096, intermediate_size=512, num_hidden_layers=2,
                     layer_types=(L, F), num_attention_heads=16, num_key_value_heads=4,
                     head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                     linear_key_head_dim=128, linear_value_head_dim=128)
SMALL_WIDTHS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    layer_types=(L, F), num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                    linear_key_head_dim=32, linear_value_head_dim=32)
SEQ = 32


def phase_config(widths: dict, *, fsdp: int = 8, batch: int = 8, hosts: int = 1) -> RunConfig:
  """`tiny:smoke` at `widths` (vocab 1,024, untied head) on a `(hosts, fsdp, 1)` mesh: params
  split over the fsdp devices of a host, `data` across hosts (the reference layout)."""
  overrides = {f"model__hf_config__{k}": v for k, v in widths.items()}
  if hosts > 1:
    overrides.update(distributed__enabled=True, distributed__num_processes=hosts)
  return RunConfig.from_config(fast_config(
      mesh__data=-1 if hosts > 1 else 1, mesh__fsdp=fsdp, mesh__tensor=1,
      model__hf_config__tie_word_embeddings=False,
      sft__global_batch_size=batch, sft__micro_batches=1, grpo__micro_batches=1,
      grpo__prompt_groups=batch // 2, grpo__group_size=2, grpo__kl_coef=0.01,
      trainer__reference_dtype="bfloat16", **overrides))


def _examples(n: int, vocab: int) -> list:
  rng = np.random.default_rng(0)
  return [(rng.integers(1, vocab, SEQ).tolist(), [0] * (SEQ // 2) + [1] * (SEQ // 2))
          for _ in range(n)]


def _grpo_batch(trainer, cfg: RunConfig, params: Any, ref: Any) -> dict:
  """A GRPO batch of random tokens (2 rows per group, advantages +-1), its old-policy and
  reference logprobs from the trainer's own passes."""
  b, vocab = cfg.grpo.prompt_groups * cfg.grpo.group_size, cfg.model.hf_config.vocab_size
  rng = np.random.default_rng(1)
  host = {"input_ids": rng.integers(1, vocab, (b, SEQ)).astype(np.int32),
          "valid": np.ones((b, SEQ), bool),
          "loss_mask": np.concatenate([np.zeros((b, SEQ // 2)), np.ones((b, SEQ // 2))],
                                      axis=1).astype(np.float32),
          "advantages": np.tile([1.0, -1.0], b // 2).astype(np.float32),
          "sampler_logp": np.full((b, SEQ), -7.0, np.float32)}
  batch = placement.place(host, trainer.batch_shardings(host))
  pass_cfg = logprob_pass_config(cfg)
  batch["old_logp"] = trainer.logprobs(params, batch, pass_cfg, "old_logp")
  batch["ref_logp"] = trainer.logprobs(ref, batch, pass_cfg, "ref_logp")
  return batch


class Recorder:
  """Per-device bytes of each named policy copy and of all live arrays, phase by phase."""

  def __init__(self):
    self.phases: list[dict] = []
    # Arrays alive before the loop starts (another test's fixtures in the same pytest worker)
    # are not the loop's: only what it creates is counted.
    self._before = {id(a) for a in jax.live_arrays()}

  def __call__(self, phase: str, **copies: Any) -> None:
    jax.effects_barrier()
    live = [a for a in jax.live_arrays() if id(a) not in self._before]
    self.phases.append({
        "phase": phase,
        "copies": {name: _by_id(sharding.bytes_per_device(tree)) for name, tree in copies.items()},
        # Each device buffer once: a checkpoint save leaves per-shard views that are live arrays.
        "live": _by_id(sharding.live_bytes_per_device(live))})


def _by_id(per_device: dict) -> dict[int, int]:
  return {d.id: n for d, n in per_device.items()}


def run_phases(cfg: RunConfig, workdir: Path, load_policy=setup.load_policy, *,
               train: bool = True) -> dict:
  """Runs the phases (see the module docstring) and returns the recorded figures, with the
  fp32 policy bytes and the exports' file lists. `train=False` skips the SFT and GRPO steps
  (their compiles): the copies are created, loaded, cast and exported the same way."""
  mesh = run_mesh(cfg)
  record = Recorder()
  model, make_params = loop._initial_policy(cfg, mesh, None)
  sft_cfg = SftConfig(num_steps=1, batch_size=cfg.sft.global_batch_size, max_len=SEQ,
                      checkpoint_every=1, keep_checkpoints=1, logprob_chunk_size=SEQ,
                      optimizer=optimizer_config(cfg.sft, 1), step=step_config(cfg.sft, cfg.trainer))
  examples = _examples(cfg.sft.global_batch_size, cfg.model.hf_config.vocab_size)
  if train:
    run_sft(model, examples, sft_cfg, workdir / "ckpt_sft", mesh=mesh,
            rules=tuple(cfg.sharding.rules), make_params=make_params)
  else:  # the initial policy as SFT creates it, without the step
    nnx.update(model, make_params(sft_trainer(model, sft_cfg, mesh, tuple(cfg.sharding.rules))))
  policy_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  record("sft", policy=nnx.state(model, nnx.Param))

  export_hf(model, workdir / "policy_sft", max_shard_bytes=policy_bytes // 3)
  multihost.barrier("sft exported")  # as the loop: process 0 wrote it, all load it
  record("evaluation export", policy=nnx.state(model, nnx.Param))
  del model

  sft_model = load_policy(cfg, workdir / "policy_sft", mesh)
  record("sft policy loaded", sft=nnx.state(sft_model, nnx.Param))
  # As the loop: the rounds keep only the SFT policy's bf16 KL reference, not the fp32 policy.
  sft_ref = loop.sft_reference(cfg, sft_model)
  del sft_model

  start = load_policy(cfg, workdir / "policy_sft", mesh)
  record("round start", reference=sft_ref, start=nnx.state(start, nnx.Param))

  trainer = grpo_trainer(cfg, start, mesh)
  ref = trainer.reference_params(sft_ref, cfg.trainer.reference_dtype)  # placed, not copied
  del sft_ref
  state = trainer.init_state(nnx.state(start, nnx.Param))
  if train:
    state, metrics = trainer.step(state, _grpo_batch(trainer, cfg, state.params, ref))
    assert int(metrics["update_applied"]) == 1, metrics
  nnx.update(start, state.params)
  record("grpo step" if train else "grpo state", policy=state.params, reference=ref,
         moments=state.opt_state)

  export_hf(start, workdir / "policy_round", dtype="bfloat16", max_shard_bytes=policy_bytes // 6)
  multihost.barrier("round exported")
  record("rollout export (bf16)", policy=state.params, reference=ref)
  files = {name: sorted(p.name for p in (workdir / name).iterdir())
           for name in ("policy_sft", "policy_round")}
  return {"phases": record.phases, "policy_bytes": int(policy_bytes), "files": files,
          "param_ways": int(mesh.size // mesh.shape["data"]), "process": jax.process_index()}


def imbalance(figures: dict, copy_bytes_of: dict[str, float]) -> list[str]:
  """What breaks "each device holds within 10% of 1/n of each policy copy" (n = the devices a
  copy is split over: fsdp x tensor; `data` replicates) and "no device holds more live bytes
  than the mean plus 10% of 1/n of a policy"; empty when everything holds."""
  n = figures["param_ways"]
  share = figures["policy_bytes"] / n
  errors = []
  for phase in figures["phases"]:
    for name, per_device in phase["copies"].items():
      want = copy_bytes_of.get(name, figures["policy_bytes"]) / n
      for dev, got in per_device.items():
        if abs(got - want) > 0.1 * want:
          errors.append(f"{phase['phase']}: device {dev} holds {got / 2**20:.1f} MiB of {name}, "
                        f"want {want / 2**20:.1f} MiB +-10%")
    live = phase["live"]
    mean = sum(live.values()) / len(live)
    for dev, got in live.items():
      if got > mean + 0.1 * share:
        errors.append(f"{phase['phase']}: device {dev} holds {got / 2**20:.1f} MiB live, the "
                      f"mean is {mean / 2**20:.1f} MiB")
  return errors


def write(figures: dict, path: Path) -> None:
  path.write_text(json.dumps(figures, indent=1))
