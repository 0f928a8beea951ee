"""Held-out markers for the Stage Bank's leakage check, exported hashed only.

The markers are the strings that identify held-out content: task ids, case ids, file and folder
names, planted-fault subjects, answers (class labels, VQA answers, report impressions and the
full expected report texts), VQA questions and the evaluator's own brief / objective wording.
Public strings are left out: they identify nothing held out and would only cause false
rejections. The rule: a marker is public when its normalised token sequence occurs inside a string
literal of the public contract (`bat_jax/workflow.py`) or of the code the training side generates
its own tasks from (`bat_jax/taskkit/`, `bat_jax/train_tasks/`), e.g. the model-card key
`intensity_scale` that a held-out fault names; so are the `workflow.ARTIFACTS` and `workflow.STAGE_TOOL_FILES`
paths and their parts, the model folder's generic `card.json` / `runner.py` / `convert.py` and bare numbers.
Report-text n-grams that occur in those literals are left out of the n-gram groups likewise.

The export is `bat_jax.markers.export_markers` (salted sha256 of NFKC-casefolded alphanumeric
token n-grams; long texts as all their 8-token windows; markers under 4 characters ignored): the
Stage Bank's `MarkerMatcher` finds a marker case-insensitively, embedded in longer text and in
nested keys or values, without ever holding the plaintext.
"""

from __future__ import annotations

import ast
import csv
import functools
import io
import secrets
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from bat_jax import markers, workflow
from bat_jax.evaluator import generators
from bat_jax.evaluator.cells import Cell
from bat_jax.io_utils import atomic_write_json
from bat_jax.taskkit import TaskInstance

MODEL_FOLDER_FILES = ("card.json", "runner.py", "convert.py")
# Training-side sources whose string literals are public vocabulary (relative to bat_jax/).
PUBLIC_SOURCES = ("workflow.py", "taskkit", "train_tasks")
_PACKAGE_ROOT = Path(workflow.__file__).resolve().parent


def _literals(path: Path) -> Iterable[str]:
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      yield node.value


@functools.cache
def public_ngrams() -> frozenset[tuple[str, ...]]:
  """Every token n-gram (n <= the marker window) of the public sources' string literals."""
  found: set[tuple[str, ...]] = set()
  for rel in PUBLIC_SOURCES:
    root = _PACKAGE_ROOT / rel
    for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
      for literal in _literals(path):
        tokens = markers.normalize_tokens(literal)
        for n in range(1, markers.DEFAULT_WINDOW + 1):
          found.update(tokens[j:j + n] for j in range(len(tokens) - n + 1))
  return frozenset(found)


def _public_names() -> frozenset[str]:
  # `intensity_scale` is the public preprocessing key every card has (and the subject of every
  # degenerate_output fault, on both sides): it identifies nothing.
  names = set(MODEL_FOLDER_FILES) | {"intensity_scale"}
  for rel in (*workflow.ARTIFACTS.values(), *workflow.STAGE_TOOL_FILES):
    names.add(rel)
    names.update(rel.split("/"))
  return frozenset(names)


PUBLIC_NAMES = _public_names()


def _path_markers(rel: str) -> list[str]:
  parts = [p for p in rel.split("/") if p not in PUBLIC_NAMES]
  return ([rel] if rel not in PUBLIC_NAMES and parts else []) + parts


def _answers(instance: TaskInstance) -> list[str]:
  """Answer strings of one task: labels / VQA answers, report impressions and full texts."""
  out: list[str] = []
  hidden = instance.hidden
  for truth in hidden["truth"].values():
    if isinstance(truth, str):
      out.append(truth)
    elif instance.track == "report":
      out.append(truth[-1])  # the impression; count / quadrant phrases are generic
  if instance.track == "report":
    out += [text for text in hidden["expected"].values() if isinstance(text, str)]
  out += instance.spec["prediction_schema"].get("labels", [])
  return out


def instance_markers(instance: TaskInstance) -> set[str]:
  """Every marker string of one held-out task."""
  hidden = instance.hidden
  found = {instance.task_id, *hidden["case_ids"], *hidden["excluded"], *hidden["env_missing"]}
  if isinstance(hidden["fault_subject"], str):
    found.add(hidden["fault_subject"])
  for rel in instance.files:
    found.update(_path_markers(rel))
  found.update(_path_markers(instance.spec["submission"]["path"]))
  found.update(_answers(instance))
  index = instance.files[instance.spec["data"]["index"]].decode()
  found.update(row["question"] for row in csv.DictReader(io.StringIO(index))
               if row.get("question"))
  return found


def static_markers() -> set[str]:
  """The evaluator's fixed wording: objectives, brief openings, VQA / report phrasing."""
  found = set(generators.OBJECTIVES.values()) | set(generators.OPENINGS)
  found.update(generators.HELDOUT_NAMES.labels)
  found.update(generators.HELDOUT_NAMES.missing_modules)
  for phrases in (*generators.IMPRESSIONS.values(), *generators.VQA_ANSWERS.values()):
    found.update(phrases)
  for names in generators.SUBMISSION_NAMES.values():
    found.update(names)
  return found


def _keep(marker: str) -> bool:
  tokens = markers.normalize_tokens(marker)
  return (marker not in PUBLIC_NAMES and len(" ".join(tokens)) >= markers.MIN_MARKER_CHARS
          and not all(t.isdigit() for t in tokens) and tokens not in public_ngrams())


def collect_markers(instances: Iterable[TaskInstance]) -> list[str]:
  """Sorted, de-duplicated marker strings of the given tasks plus the static wording."""
  found = static_markers()
  for instance in instances:
    found |= instance_markers(instance)
  return sorted(m for m in found if _keep(m))


def export_cells(cells: Sequence[Cell], salt: Optional[bytes] = None) -> dict[str, Any]:
  """The hashed marker export of a cell set (random salt unless given)."""
  strings = collect_markers(c.instance() for c in cells)
  public_grams = (g for g in public_ngrams() if len(g) == markers.GRAM_N)
  return markers.export_markers(strings, secrets.token_bytes(16) if salt is None else salt,
                                public_grams=public_grams)


def write_export(export: dict[str, Any], path: Path) -> Path:
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  atomic_write_json(str(path), export)
  return Path(path)
