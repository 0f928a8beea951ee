"""What one device holds in each phase of the BiCuRL loop, component by component.

`bat_jax.memory_plan` compiles the run's programs and measures the state; this module adds up,
per phase, everything the loop keeps on a device at that point (bytes per device):

* sft: the SFT trainer's params, AdamW moments and its step (temp, batch, outputs). The rollout
  server is not started yet (the loop starts it after the SFT export).
* evaluation/export and rollout: the round's training params and moments, the KL reference
  (the SFT policy cast once to `trainer.reference_dtype`; the fp32 SFT policy itself is dropped
  once the rollout server has started and the SFT evaluation is done), and one bf16
  export cast (the candidate export / the weight sync before rollouts; the export casts each
  device's own slices shard by shard, never a gathered tree (issue 25 item 1), so the plan
  counts one device's slices cast at once: an upper bound of one safetensors shard's cast),
  beside the serving rollout server.
* grpo_step: the same resident copies plus the largest of the old-policy pass, the reference
  pass and the donated step; the rollout server released (`rollout.sglang.release_memory`)
  keeps `memory.rollout_reserved_gib`.

The rollout server's static share follows SGLang 0.5.23
(`kv_cache_configurator._profile_available_bytes`): `mem_fraction_static` of the memory FREE when
it starts, i.e. after JAX's context and what JAX holds at launch (the SFT policy; under the
"fraction" layout the whole preallocated pool) and its own CUDA / NCCL context (estimated as
`memory.jax_context_gib`). That share (weights + KV pool) is fixed at start-up, so it must still
fit when JAX later holds the round's state. The rollout model is what the export writes: the
policy's own text model in bf16 (no vision tower). Framework contexts are stated margins
(`memory.jax_context_gib`, `memory.rollout_reserved_gib`, `memory.rollout_activation_gib`).
A phase fits when it leaves `memory.headroom_gib` of `memory.device_gib` (what the card
reports: ~79.6 GiB for an "80 GB" card) free.
"""

from __future__ import annotations

import dataclasses
from typing import Any

GIB = 2**30
PHASES = ("sft", "evaluation/export", "rollout", "grpo_step")


@dataclasses.dataclass(frozen=True)
class Holdings:
  """Bytes per device of each thing the loop holds (from the compiled plan)."""
  sft_params: int        # the SFT trainer's params
  sft_optimizer: int     # and AdamW moments
  sft_program: int       # the SFT step beyond its state (temp, batch, outputs)
  params: int            # a round's training params (the round start, fp32)
  optimizer: int         # its AdamW moments
  reference: int         # the KL reference (0 without KL)
  sft_policy: int        # the SFT policy, held when the rollout server starts (not in rounds)
  export_cast: int       # one device's slices cast to the export dtype
  grpo_program: int      # the largest of the logprob passes and the step beyond their state
  rollout_need: int      # one rollout server's weights + KV / state for its trajectories


def _gib(cfg, name: str) -> int:
  return int(getattr(cfg.memory, name) * GIB)


def rollout_share(cfg, jax_at_launch: int) -> dict[str, int]:
  """The rollout server's static share (SGLang 0.5.23: `mem_fraction_static` of the memory
  free at its start) and JAX's pool under the "fraction" layout."""
  from bat_jax.config_validation import MEMORY_LAYOUTS
  if cfg.memory.layout not in MEMORY_LAYOUTS:
    raise ValueError(f"config.memory.layout={cfg.memory.layout!r} is not one of "
                     f"{list(MEMORY_LAYOUTS)}")
  capacity, context = _gib(cfg, "device_gib"), _gib(cfg, "jax_context_gib")
  pool = 0
  if cfg.memory.layout == "fraction":
    pool = int(capacity * (cfg.distributed.xla_mem_fraction or 1.0))
    jax_at_launch = max(jax_at_launch, pool)
  free = max(capacity - context - jax_at_launch - context, 0)  # JAX's and SGLang's contexts
  return {"free_at_launch": free, "static": int(free * cfg.rollout.sglang.mem_fraction_static),
          "jax_pool": pool}


def phase_table(cfg, h: Holdings) -> dict[str, Any]:
  """Per phase and component, bytes per device; totals, headroom and `fits` per phase."""
  uses_sglang = cfg.rollout.engine == "sglang"
  share = rollout_share(cfg, h.sft_policy) if uses_sglang else {"static": 0, "jax_pool": 0,
                                                                 "free_at_launch": 0}
  serving = {"context": _gib(cfg, "rollout_reserved_gib"), "static": share["static"],
             "activations": _gib(cfg, "rollout_activation_gib")}
  released = dict(serving, static=0, activations=0)
  if not cfg.rollout.sglang.release_memory:
    released = serving
  if not uses_sglang:
    serving = released = {"context": 0, "static": 0, "activations": 0}
  # The fp32 SFT policy is held only until the rollout server starts (its share is fixed by
  # then); the rounds keep only the KL reference cast from it (`bicurl.loop.sft_reference`).
  resident = {"training params (round start)": h.params,
              "AdamW moments": h.optimizer, "KL reference": h.reference}
  jax_rows = {
      "sft": {"training params (round start)": h.sft_params, "AdamW moments": h.sft_optimizer,
              "step program (temp + I/O)": h.sft_program},
      "evaluation/export": {**resident, "export cast (bf16 slices)": h.export_cast},
      "rollout": {**resident, "export cast (bf16 slices)": h.export_cast},
      "grpo_step": {**resident, "step program (temp + I/O)": h.grpo_program},
  }
  sglang = {"sft": {"context": 0, "static": 0, "activations": 0}, "evaluation/export": serving,
            "rollout": serving, "grpo_step": released}
  capacity, headroom = _gib(cfg, "device_gib"), _gib(cfg, "headroom_gib")
  order = ("JAX framework contexts (margin)", *resident, "export cast (bf16 slices)",
           "step program (temp + I/O)", "JAX pool not in use (fraction layout)",
           "rollout server context + graphs (margin)",
           "rollout server static share (weights + KV)", "rollout server activations (margin)")
  components = {name: {p: 0 for p in PHASES} for name in order}
  totals, jax_totals = {}, {}
  for phase in PHASES:
    rows = {"JAX framework contexts (margin)": _gib(cfg, "jax_context_gib"), **jax_rows[phase]}
    jax_used = sum(rows.values())
    if share["jax_pool"]:  # a preallocated pool is held whole, used or not
      rows["JAX pool not in use (fraction layout)"] = max(share["jax_pool"] + rows[
          "JAX framework contexts (margin)"] - jax_used, 0)
    rows["rollout server context + graphs (margin)"] = sglang[phase]["context"]
    rows["rollout server static share (weights + KV)"] = sglang[phase]["static"]
    rows["rollout server activations (margin)"] = sglang[phase]["activations"]
    for name, value in rows.items():
      components[name][phase] = value
    totals[phase], jax_totals[phase] = sum(rows.values()), jax_used
  jax_fits = {p: not share["jax_pool"] or jax_totals[p] <= share["jax_pool"] + _gib(
      cfg, "jax_context_gib") for p in PHASES}
  fits = {p: totals[p] + headroom <= capacity and jax_fits[p] for p in PHASES}
  rollout_fits = not uses_sglang or h.rollout_need <= share["static"]
  return {"components": components, "totals": totals, "capacity": capacity,
          "headroom_required": headroom,
          "headroom": {p: capacity - totals[p] for p in PHASES}, "fits": fits,
          "rollout": {**share, "need": h.rollout_need}, "rollout_fits": rollout_fits,
          "all_fit": bool(all(fits.values()) and rollout_fits)}


def format_phase_table(table: dict[str, Any]) -> str:
  gib = lambda b: f"{b / GIB:9.2f}"
  width = 44
  lines = [f"{'per device (GiB)':<{width}}" + "".join(f"{p:>19}" for p in PHASES)]
  for name, values in table["components"].items():
    if any(values.values()):
      lines.append(f"{name:<{width}}" + "".join(f"{gib(values[p]):>19}" for p in PHASES))
  lines.append(f"{'total':<{width}}" + "".join(f"{gib(table['totals'][p]):>19}" for p in PHASES))
  lines.append(f"{'free of ' + gib(table['capacity']).strip() + ' (need ' + gib(table['headroom_required']).strip() + ')':<{width}}"
               + "".join(f"{gib(table['headroom'][p]):>19}" for p in PHASES))
  lines.append(f"{'fits':<{width}}" + "".join(f"{str(table['fits'][p]).lower():>19}"
                                               for p in PHASES))
  r = table["rollout"]
  lines.append(f"rollout server: free at its start {gib(r['free_at_launch']).strip()}, static "
               f"share {gib(r['static']).strip()}, need {gib(r['need']).strip()} (weights + KV "
               f"and state of its trajectories): {'fits' if table['rollout_fits'] else 'DOES NOT FIT'}")
  return "\n".join(lines)
