"""The training side's task families: its name pool, its seed stream and its family instances.

The sampling logic and the workspace builder are shared machinery (`bat_jax.taskkit`); what makes
these the TRAINING tasks is the vocabulary and seed stream below (`TRAIN_NAMES`) and the brief
wording (`bat_jax.tasks.briefs`). The held-out evaluator binds the same machinery to its own.
"""

from __future__ import annotations

from bat_jax.taskkit.base import NamePool, TrackFamily
from bat_jax.taskkit.families import FAMILY_TYPES
from bat_jax.tasks.briefs import make_brief

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
