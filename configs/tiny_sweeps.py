r"""Ablation sweeps over configs/tiny.py, as flat config overrides.

Each sweep is a list of variants; a variant is `{"dotted.field": value}` applied on top of the
tiny config, so every variant runs the same number of GRPO steps and is evaluated on the same
paired cells. An experiment script runs, e.g.

  for name, overrides in get_sweep("curriculum_mode"):
    cfg = apply_overrides(tiny.get_config(), overrides)

or the same from the shell: `--config.curriculum.mode=uniform`.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import ml_collections

from bat_jax import curriculum

Variant = tuple[str, dict[str, Any]]


def _pool_mix(s_target: int, s_mix: int, e2e: int) -> dict[str, Any]:
  return {"curriculum.pool_mix.s_target": s_target, "curriculum.pool_mix.s_mix": s_mix,
          "curriculum.pool_mix.e2e": e2e}


SWEEPS: Mapping[str, tuple[Variant, ...]] = {
    # The curriculum itself: BaT's argmin against its ablations, every registered mode.
    "curriculum_mode": tuple((mode, {"curriculum.mode": mode}) for mode in curriculum.MODES),
    # Rows per batch of 8 from the S-target / S-mix / E2E pools (reference 4/2/2).
    "pool_mix": (("4-2-2", _pool_mix(4, 2, 2)), ("6-1-1", _pool_mix(6, 1, 1)),
                 ("2-3-3", _pool_mix(2, 3, 3)), ("0-4-4", _pool_mix(0, 4, 4))),
    # Continuations per state_id at a fixed number of trajectories per update (16).
    "group_size": tuple((f"G{g}", {"grpo.group_size": g, "grpo.prompt_groups": 16 // g})
                        for g in (2, 4, 8)),
    # The KL anchor's weight: the reference's 0.006 up to the tiny default's 0.5 and beyond
    # (experiments/README.md, "The KL anchor").
    "kl_coef": tuple((f"kl{k:g}", {"grpo.kl_coef": k}) for k in (0.006, 0.1, 0.5, 2.0)),
    # GRPO's step size at the tiny default's KL anchor (0.5): 1e-4 (the default until run m1),
    # the default 3e-4, and 5e-4 with the first steps warmed up (experiments/README.md,
    # "GRPO's step").
    "grpo_lr": (("lr1e-4", {"grpo.lr": 1e-4}), ("lr3e-4", {"grpo.lr": 3e-4}),
                ("lr5e-4-warm3", {"grpo.lr": 5e-4, "grpo.warmup_steps": 3})),
}


def get_sweep(name: str) -> tuple[Variant, ...]:
  """The variants of one sweep, as `(label, overrides)` pairs."""
  if name not in SWEEPS:
    raise ValueError(f"unknown sweep {name!r}; expected one of {sorted(SWEEPS)}")
  return SWEEPS[name]


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `config` with dotted-path overrides; a misspelt path raises KeyError naming it."""
  out = copy.deepcopy(config)
  out.update_from_flattened_dict(dict(overrides))
  return out
