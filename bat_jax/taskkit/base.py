"""The task-family protocol and the generic workspace builder shared by every track.

A family is data + a stdlib "model" + a task metric + a native submission schema. It only
samples cases (`TrackFamily.sample`); everything else -- names, the model folder (card, weights,
runner, converter), planted faults, the spec, the brief and the hidden answers -- is generic.
A family instance is bound to a `NamePool` (vocabulary and seed stream: ids, file names,
values) and a `BriefWriter` (the wording of its E2E brief): the training side
(`bat_jax.train_tasks`) and the held-out evaluator each bind their own, so neither side's content lives here.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import random
import types
from typing import Any, Callable, ClassVar, Mapping, Optional

from bat_jax import workflow
from bat_jax.taskkit import metrics, sources
from bat_jax.taskkit.runners import common
from bat_jax.taskkit.scripts import checks, convert

_MAX_ATTEMPTS = 64


@dataclasses.dataclass(frozen=True)
class NamePool:
  """Vocabulary that names things in a workspace, plus the seed stream (`salt`) of its values.

  Each side (training, held-out evaluator) owns one; tasks of different pools share no names.
  """
  salt: str
  case_prefixes: tuple[str, ...]
  data_dirs: tuple[str, ...]
  index_names: tuple[str, ...]
  model_words: tuple[str, ...]
  weight_stems: tuple[str, ...]
  missing_modules: tuple[str, ...]
  labels: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TaskInstance:
  """One generated task. `hidden` never enters the workspace.

  hidden keys: fault, fault_subject, case_ids (cases that must be predicted), excluded,
  validation_ids, truth {case_id: answer}, expected {case_id: prediction of the correct
  pipeline}, env_missing, compatible, load_ok, weights (relpath), supported_formats,
  impressions (report: the model's impression phrases, for the metric's precision), probe
  (`Probe` as a dict: unseen cases the rubric runs the agent's pipeline on).
  """
  task_id: str
  track: str
  outcome: str
  seed: int
  files: Mapping[str, bytes]
  brief: str
  hidden: Mapping[str, Any]
  action_space: str = "code"   # workflow.ACTION_SPACES; `taskkit.toolspace.with_stage_tools`

  @property
  def spec(self) -> dict:
    return json.loads(self.files[workflow.ARTIFACTS["spec"]])


@dataclasses.dataclass(frozen=True)
class SampleContext:
  """What the generic builder fixes before a family samples its cases."""
  rng: random.Random
  names: NamePool
  width: int
  height: int
  maxval: int
  case_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CaseData:
  """A family's sample: the data index, its files, the truths and the model's params.

  rows: index rows (str values; `case_id` first; an `image` column names a PGM in `files`).
  files: data files relative to the data folder. truth: case_id -> metric truth.
  schema: prediction schema (`checks.prediction_ok`). submission: native format
  (`submission.write_submission`).
  """
  columns: tuple[str, ...]
  rows: tuple[dict, ...]
  files: Mapping[str, bytes]
  truth: Mapping[str, Any]
  params: Mapping[str, Any]
  schema: Mapping[str, Any]
  submission: Mapping[str, Any]


# A probe case id is a validation case id plus this suffix (never a case of the workspace).
PROBE_SUFFIX = "-probe"


def _mirrored(row: Mapping[str, str], files: Mapping[str, bytes]) -> tuple[dict, dict]:
  """A left-right mirror of one case (its image, or an `cx` condition): (row, its files)."""
  out = dict(row, case_id=row["case_id"] + PROBE_SUFFIX)
  if row.get("image"):
    _, _, maxval, px = common.parse_pgm(files[row["image"]].decode("ascii"), row["image"])
    out["image"] = "mirror_" + row["image"]
    return out, {out["image"]: pgm_bytes([r[::-1] for r in px], maxval)}
  out["cx"] = str(int(row["width"]) - 1 - int(row["cx"]))
  return out, {}


def pgm_bytes(rows: list[list[int]], maxval: int) -> bytes:
  return common.format_pgm(rows, maxval).encode("ascii")


def opaque_task_id(*parts: Any) -> str:
  """`task-<14 hex>`: one form for training and held-out tasks, naming neither the outcome
  nor the split, so no shortcut can be learned from the id."""
  return "task-" + hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:14]


def sha256_bytes(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _rng(*parts: object) -> random.Random:
  return random.Random(hashlib.sha256(":".join(map(str, parts)).encode()).digest())


def _case_ids(rng: random.Random, names: NamePool, n: int) -> tuple[str, ...]:
  prefix = rng.choice(names.case_prefixes)
  style = rng.randrange(3)
  ids: set[str] = set()
  while len(ids) < n:
    if style == 0:
      ids.add(f"{prefix}-{rng.randrange(1000):03d}")
    elif style == 1:
      ids.add(f"{prefix}_{rng.randrange(16 ** 4):04x}")
    else:
      ids.add(f"{prefix.upper()}{rng.randrange(100000):05d}")
  return tuple(sorted(ids))


@dataclasses.dataclass(frozen=True)
class _ModelFolder:
  """The model folder of a task: relpaths of its card and weights, and its files."""
  card: str
  weights: str
  version: int
  missing: Optional[str]      # the module a missing_dependency task's runner imports
  files: Mapping[str, bytes]
  clean_runner: str           # the runner as it would be without a planted dependency


def _csv_bytes(columns: tuple[str, ...], rows: tuple[dict, ...]) -> bytes:
  lines = [",".join(columns)] + [",".join(str(r[c]) for c in columns) for r in rows]
  return ("\n".join(lines) + "\n").encode()


# (rng, track, objective) -> the task's E2E user message. Called last, so it never changes the
# values of the task it describes.
BriefWriter = Callable[[random.Random, str, str], str]


class TrackFamily(abc.ABC):
  """One track: subclasses sample cases; `generate` builds the whole task around them.

  Args:
    names: the vocabulary and seed stream every generated task draws from.
    write_brief: writes the E2E brief of a generated task.
  """
  track: ClassVar[str]
  runner: ClassVar[types.ModuleType]
  objective: ClassVar[str]  # one sentence: what the submission must contain

  def __init__(self, names: NamePool, write_brief: BriefWriter):
    self.names = names
    self.write_brief = write_brief

  @abc.abstractmethod
  def sample(self, ctx: SampleContext) -> CaseData:
    """Cases, truths and model params for one task."""

  def validation_group(self, row: Mapping[str, str], params: Mapping[str, Any]) -> str:
    """Validation cases come from one group (e.g. one VQA question type)."""
    del row, params
    return ""

  def predict(self, params: Mapping[str, Any], row: Mapping[str, str],
              files: Mapping[str, bytes], scale: Optional[float]) -> Any:
    """The provided model's prediction for one case, computed host-side on clean data."""
    image = None
    if row.get("image"):
      image = common.parse_pgm(files[row["image"]].decode("ascii"), row["image"])
    return self.runner.predict_case(params, row, image, scale)

  def generate(self, seed: int, outcome: str) -> TaskInstance:
    """A deterministic task for (seed, outcome); values and names vary widely with the seed."""
    names = self.names
    if outcome not in workflow.OUTCOMES:
      raise ValueError(f"unknown outcome {outcome!r}; expected one of {workflow.OUTCOMES}")
    rng = _rng(names.salt, self.track, outcome, seed)
    faults = workflow.FAULTS[outcome]
    fault = rng.choice(faults) if faults else None
    for _ in range(_MAX_ATTEMPTS):
      built = self._try_build(rng, names, seed, outcome, fault)
      if built is not None:
        return built
    raise RuntimeError(f"{self.track}/{outcome}/seed {seed}: no valid sample in "
                       f"{_MAX_ATTEMPTS} attempts")

  def _pick_validation(self, rng: random.Random, data: CaseData,
                       expected: Mapping[str, Any]) -> Optional[list[str]]:
    """Two cases of one group whose correct predictions differ (so degeneracy shows)."""
    rows = list(data.rows)
    rng.shuffle(rows)
    for a in rows:
      for b in rows:
        same_group = (self.validation_group(a, data.params)
                      == self.validation_group(b, data.params))
        if (a["case_id"] < b["case_id"] and same_group
            and json.dumps(expected[a["case_id"]]) != json.dumps(expected[b["case_id"]])):
          return [a["case_id"], b["case_id"]]
    return None

  def _try_build(self, rng: random.Random, names: NamePool, seed: int, outcome: str,
                 fault: Optional[str]) -> Optional[TaskInstance]:
    maxval = 4095 if fault == "degenerate_output" else rng.choice((255, 1023, 4095))
    ctx = SampleContext(rng=rng, names=names, width=rng.randint(12, 18),
                        height=rng.randint(12, 18), maxval=maxval,
                        case_ids=_case_ids(rng, names, rng.randint(5, 8)))
    data = self.sample(ctx)
    expected = {r["case_id"]: self.predict(data.params, r, data.files, None) for r in data.rows}
    quality = [metrics.case_score(self.track, data.truth[c], p) for c, p in expected.items()]
    if min(quality) < 0.97:
      return None
    validation = self._pick_validation(rng, data, expected)
    if validation is None or checks.degenerate([expected[c] for c in validation], data.schema):
      return None
    card_scale: Any = "maxval"
    if fault == "degenerate_output":
      card_scale = 255
      wrong = [self.predict(data.params, r, data.files, 255.0) for r in data.rows
               if r["case_id"] in validation]
      if not checks.degenerate(wrong, data.schema):
        return None
    files = {k: v for k, v in data.files.items()}
    excluded: list[str] = []
    if fault == "corrupted_case":
      # A case whose input is broken: a truncated image, or (no image) a garbled index row.
      spare = [r for r in data.rows if r["case_id"] not in validation
               and sum(1 for s in data.rows if s.get("image", 0) == r.get("image", 1)) <= 1]
      if not spare:
        return None
      bad = rng.choice(spare)
      if bad.get("image"):
        text = files[bad["image"]].decode("ascii").split()
        files[bad["image"]] = " ".join(text[:4 + len(text[4:]) * 3 // 5]).encode("ascii")
      else:
        field = rng.choice([c for c in data.columns if c != "case_id"])
        data = dataclasses.replace(data, rows=tuple(
            dict(r, **{field: rng.choice(("n/a", "??", "#REF!"))}) if r is bad else r
            for r in data.rows))
      excluded = [bad["case_id"]]
      validation = sorted(validation + excluded)
    return self._assemble(rng, names, seed=seed, outcome=outcome, fault=fault, data=data,
                          files=files, expected=expected, validation=validation,
                          excluded=excluded, card_scale=card_scale, maxval=maxval)

  def _probe(self, data: CaseData, validation: list[str], runner_src: str, version: int,
             files: Mapping[str, bytes]) -> dict:
    """Mirrors of the (clean) validation cases with the clean model, for the S2 pipeline check:
    cases no workspace holds, so only a pipeline that runs the model gets them right. JSON
    values only (strings, not bytes)."""
    rows, probe_files = [], {}
    for row in data.rows:
      if row["case_id"] in validation:
        mirrored, extra = _mirrored(row, files)
        rows.append(mirrored)
        probe_files.update(extra)
    expected = {r["case_id"]: self.predict(data.params, r, probe_files, None) for r in rows}
    return {"columns": list(data.columns), "rows": rows, "expected": expected,
            "files": {k: v.decode("ascii") for k, v in probe_files.items()},
            "runner": runner_src, "weights": json.dumps(
                {"format_version": version, "params": data.params}, sort_keys=True)}

  def _model_folder(self, rng: random.Random, names: NamePool, fault: Optional[str],
                    data: CaseData, card_scale: Any) -> _ModelFolder:
    """The provided model: card, weights (with the planted checkpoint fault), runner, converter."""
    model = f"{rng.choice(names.model_words)}-{self.track[:3]}-{rng.randint(1, 9)}"
    model_dir = f"{workflow.ARTIFACTS['model_dir']}/{model}"
    version = rng.randint(2, 5)
    weights_name = f"{rng.choice(names.weight_stems)}_{rng.choice(('v', 'e', 'r'))}" \
                   f"{rng.randint(1, 40)}.json"
    params = json.loads(json.dumps(data.params))
    intact = json.dumps({"format_version": version, "params": params}, sort_keys=True).encode()
    weights = intact
    if fault == "version_mismatch":
      weights = json.dumps({"format_version": version + 1,
                            "params_json": json.dumps(params, sort_keys=True)}).encode()
    if fault == "corrupted_checkpoint":
      weights = intact[: len(intact) // 2]
    missing = (f"{rng.choice(names.missing_modules)}{rng.randint(2, 9)}"
               if fault == "missing_dependency" else None)
    requires = ["json", "math", "os"] + ([missing] if missing else [])
    formats = (("SUPPORTED_FORMATS = (2,)", f"SUPPORTED_FORMATS = ({version},)"),)
    clean_runner = sources.inline_source(common, self.runner, replace=formats)
    runner_src = sources.inline_source(
        common, self.runner,
        replace=formats + ((("import os\n", f"import os\n\nimport {missing}  # native kernels\n"),)
                           if missing else ()))
    card = {"name": model, "track": self.track, "weights": weights_name,
            "sha256": sha256_bytes(weights if fault != "corrupted_checkpoint" else intact),
            "format_version": version + (fault == "version_mismatch"),
            "runner": {"entry": "runner.py", "supports_format_versions": [version]},
            "converter": "convert.py", "requires": requires,
            "preprocess": {"intensity_scale": card_scale},
            "output": dict(data.schema)}
    files = {f"{model_dir}/card.json": json.dumps(card, indent=1, sort_keys=True).encode(),
             f"{model_dir}/{weights_name}": weights,
             f"{model_dir}/runner.py": runner_src.encode(),
             f"{model_dir}/convert.py": sources.inline_source(checks, convert).encode()}
    return _ModelFolder(card=f"{model_dir}/card.json", weights=f"{model_dir}/{weights_name}",
                        version=version, missing=missing, files=files,
                        clean_runner=clean_runner)

  def _assemble(self, rng: random.Random, names: NamePool, *, seed: int, outcome: str,
                fault: Optional[str], data: CaseData, files: Mapping[str, bytes],
                expected: Mapping[str, Any], validation: list[str], excluded: list[str],
                card_scale: Any, maxval: int) -> TaskInstance:
    """Model folder, planted fault, spec, brief and hidden answers around a sample."""
    folder = self._model_folder(rng, names, fault, data, card_scale)
    weights_rel, missing, version = folder.weights, folder.missing, folder.version
    data_dir = (f"{workflow.ARTIFACTS['data_dir']}/{rng.choice(names.data_dirs)}_"
                f"{rng.randint(1, 99)}")
    index_rel = f"{data_dir}/{rng.choice(names.index_names)}.csv"
    task_id = opaque_task_id(names.salt, self.track, outcome, seed)
    spec = {"task_id": task_id, "track": self.track, "objective": self.objective,
            "data": {"dir": data_dir, "index": index_rel},
            "model": {"card": folder.card},
            "validation_case_ids": validation,
            "prediction_schema": dict(data.schema), "submission": dict(data.submission),
            "artifacts": dict(workflow.ARTIFACTS),
            "record_fields": dict(workflow.RECORD_FIELDS),
            "receipt": {"fields": list(workflow.RECEIPT_FIELDS),
                        "files": "{relpath: sha256} of the files it vouches for"},
            "known_faults": sorted({f for fs in workflow.FAULTS.values() for f in fs})}
    ws: dict[str, bytes] = {f"{data_dir}/{k}": v for k, v in files.items()}
    ws[index_rel] = _csv_bytes(data.columns, data.rows)
    ws.update(folder.files)
    ws[workflow.ARTIFACTS["spec"]] = json.dumps(spec, indent=1, sort_keys=True).encode()
    subject = {"corrupted_case": excluded[0] if excluded else None,
               "version_mismatch": weights_rel, "degenerate_output": "intensity_scale",
               "missing_dependency": missing, "corrupted_checkpoint": weights_rel}.get(fault)
    case_ids = sorted(c for c in expected if c not in excluded)
    hidden = {
        "fault": fault, "fault_subject": subject, "case_ids": case_ids, "excluded": excluded,
        "validation_ids": validation, "truth": {c: data.truth[c] for c in case_ids},
        "expected": {c: expected[c] for c in case_ids},
        "env_missing": [missing] if missing else [],
        "compatible": fault not in ("version_mismatch", "corrupted_checkpoint"),
        "load_ok": fault not in ("version_mismatch", "corrupted_checkpoint",
                                 "missing_dependency"),
        "weights": weights_rel, "supported_formats": [version],
        "data_dir": data_dir, "n_cases": len(data.rows), "maxval": maxval,
        "impressions": sorted(data.params.get("impressions", {}).values()),
        "probe": self._probe(data, [c for c in validation if c not in excluded],
                             folder.clean_runner, version, files)}
    brief = self.write_brief(rng, self.track, self.objective)
    return TaskInstance(task_id=task_id, track=self.track, outcome=outcome, seed=seed,
                        files=ws, brief=brief, hidden=hidden)
