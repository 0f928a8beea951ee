"""The training side's task families: its name pool, its seed stream and its family instances.

The sampling logic and the workspace builder are shared machinery (`bat_jax.taskkit`); what makes
these the TRAINING tasks is the vocabulary and seed stream below (`TRAIN_NAMES`) and the brief
wording (`bat_jax.train_tasks.briefs`). The held-out evaluator binds the same machinery to its own.
"""

from __future__ import annotations

import dataclasses

from bat_jax import workflow
from bat_jax.taskkit import toolspace
from bat_jax.taskkit.base import NamePool, TaskInstance, TrackFamily
from bat_jax.taskkit.families import FAMILY_TYPES
from bat_jax.train_tasks.briefs import make_brief, tools_brief

TRAIN_NAMES = NamePool(
    salt="train",
    case_prefixes=("case", "pt", "scan", "subj", "img", "study", "vol", "sl", "acq", "ex"),
    data_dirs=("scans", "images", "cohort", "study", "batch", "series", "archive", "intake"),
    index_names=("index", "manifest", "cases", "listing", "catalog", "inventory"),
    model_words=("lumen", "apex", "vertex", "cortex", "helix", "prism", "quanta", "aurora",
                 "sable", "orion", "delta", "nimbus", "pulse", "ember"),
    weight_stems=("weights", "params", "checkpoint", "model", "export", "state"),
    missing_modules=("fastmorph", "radkit_native", "voxelops", "medfilt_c", "lesionlib",
                     "scanio_ext", "cudaprep", "dicomkit"),
    labels=("benign", "malignant", "normal", "cyst", "nodule", "calcified", "inflamed",
            "fibrotic", "edema", "atelectasis", "granuloma", "effusion"),
)

FAMILIES: dict[str, TrackFamily] = {
    track: family_type(TRAIN_NAMES, make_brief) for track, family_type in FAMILY_TYPES.items()}


def generate(track: str, seed: int, outcome: str, action_space: str = "code") -> TaskInstance:
  """The training task of (track, seed, outcome) in `action_space` (workflow.ACTION_SPACES)."""
  workflow.check_action_space(action_space)
  if track not in FAMILIES:
    raise ValueError(f"unknown track {track!r}; expected one of {workflow.TRACKS}")
  instance = FAMILIES[track].generate(seed, outcome)
  if action_space == "stage_tools":
    instance = toolspace.with_stage_tools(instance)
    instance = dataclasses.replace(instance, brief=tools_brief(instance))
  return instance
