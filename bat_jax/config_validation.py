"""The checks of a run config that no single section's dataclass can make, naming each bad field.

The ConfigDict lock already rejects misspelt fields and ml_collections rejects wrong types;
`typed_sections` builds the sections the code owns a dataclass for (SamplingParams,
RolloutLimits, SandboxLimits, CurriculumConfig, GateThresholds, EvalSettings), whose own checks
refuse bad values. What is left here: enumerations checked against the code's
registries (GRPO advantage, KL, loss-aggregation, schedule and remat registries; supported
model types; mesh axes; evaluator tiers), ranges of sections that stay ConfigDicts, and checks
across fields (batch divisibility, tokenizer vs model vocabulary, cache vs context length), and
the documented range of every numeric field (`bat_jax.config_bounds.BOUNDS`). `typed_sections`
then builds the dataclass sections; `RunConfig.from_config` assembles them (this module does not
import `run_config`: validating is building, in one direction). Every problem is one line
`config.<path>: <what is wrong>`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Iterable

from ml_collections import ConfigDict

from bat_jax import config_bounds, sharding, workflow
from bat_jax.curriculum import CurriculumConfig
from bat_jax.evaluator.evaluate import EvalSettings
from bat_jax.evaluator.external import ExternalEvaluator
from bat_jax.evaluator.generators import TIERS as EVALUATOR_TIERS
from bat_jax.gate import GateThresholds
from bat_jax.grpo import ADVANTAGE_ESTIMATORS
from bat_jax.grpo.advantages import CREDIT_MODES
from bat_jax.grpo.loss import validate_loss_config
from bat_jax.model.attention import ATTENTION_IMPLS
from bat_jax.model.compact_chat import PREAMBLES as TOOL_PREAMBLES
from bat_jax.model.config import SUPPORTED_MODEL_TYPES
from bat_jax.rollout.engine import SamplingParams
from bat_jax.rollout.sglang_launcher import SERVER_MODULES, SERVING_DTYPES
from bat_jax.rollout_protocol import RolloutLimits
from bat_jax.sandbox import SandboxLimits
from bat_jax.sharding import MESH_AXES
from bat_jax.train import REMAT_POLICIES, SCHEDULES

MODEL_SOURCES = ("scratch", "tiny_base", "pretrained")
# Sources whose architecture is `model.hf_config` (initialised here, not read from a checkpoint).
FROM_HF_CONFIG = ("scratch", "tiny_base")
LAYER_TYPES = ("linear_attention", "full_attention")
DTYPES = ("float32", "bfloat16", "float16")
TOKENIZER_SOURCES = ("pretrained", "train")
ROLLOUT_ENGINES = ("jax", "sglang")
# Engines whose completions carry the sampler's per-token logprobs (truncated IS needs them).
ENGINES_WITH_SAMPLER_LOGPROBS = ("jax", "sglang")
KL_REFERENCES = ("sft", "round_start")
# Where the ratio's old logprobs come from (bat_jax.bicurl.grpo_round.GrpoRound.prepare).
OLD_LOGP_SOURCES = ("step", "pass")
MEMORY_LAYOUTS = ("fraction", "timeshare")  # bat_jax.memory_plan.layout_budget
STAGEBANK_MODES = ("spawn", "connect")
EVALUATOR_KINDS = ("builtin", "external")
EXTERNAL_PLACEHOLDERS = ("{checkpoint}", "{request}", "{output}")
# Fields a from-scratch model's hf_config must give (the rest have HF defaults).
REQUIRED_HF_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                      "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


class ConfigError(ValueError):
  """One or more config fields are invalid; the message names each one."""


class _Checker:
  """Collects `config.<path>: message` lines."""

  def __init__(self, cfg: ConfigDict):
    self.cfg = cfg
    self.errors: list[str] = []

  def get(self, path: str) -> Any:
    node: Any = self.cfg
    for part in path.split("."):
      node = node[part]
    return node

  def fail(self, path: str, message: str) -> None:
    self.errors.append(f"config.{path}: {message}")

  def one_of(self, path: str, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    value = self.get(path)
    if value not in choices:
      self.fail(path, f"{value!r} is not one of {list(choices)}")

  def that(self, path: str, ok: Callable[[Any], bool], what: str) -> None:
    value = self.get(path)
    if value is None or isinstance(value, bool) or not ok(value):
      self.fail(path, f"must be {what}, got {value!r}")

  def flag(self, *paths: str) -> None:
    for path in paths:
      if not isinstance(self.get(path), bool):
        self.fail(path, f"must be True or False, got {self.get(path)!r}")

  def positive(self, *paths: str) -> None:
    for p in paths:
      self.that(p, lambda v: v > 0, "> 0")

  def fraction(self, path: str, lo_open: bool = False) -> None:
    if lo_open:
      self.that(path, lambda v: 0 < v <= 1, "in (0, 1]")
    else:
      self.that(path, lambda v: 0 <= v < 1, "in [0, 1)")

  def divides(self, path_batch: str, path_micro: str) -> None:
    batch, micro = self.get(path_batch), self.get(path_micro)
    if isinstance(batch, int) and isinstance(micro, int) and micro > 0 and batch % micro:
      self.fail(path_micro, f"{micro} does not divide the batch ({path_batch} = {batch})")


def _check_model(ck: _Checker) -> None:
  ck.one_of("model.source", MODEL_SOURCES)
  ck.one_of("model.dtype", DTYPES)
  ck.one_of("model.param_dtype", DTYPES)
  hf = ck.get("model.hf_config")
  source = ck.get("model.source")
  if source == "pretrained":
    if not ck.get("model.path"):
      ck.fail("model.path", "a pretrained model needs a local checkpoint directory")
    if len(hf):
      ck.fail("model.hf_config", "only used with model.source='scratch'; leave it empty")
  elif source in FROM_HF_CONFIG:
    missing = [k for k in REQUIRED_HF_FIELDS if k not in hf]
    if missing:
      ck.fail("model.hf_config", f"a {source} model needs the fields {missing}")
      return
    ck.one_of("model.hf_config.model_type", SUPPORTED_MODEL_TYPES)
    ck.positive(*(f"model.hf_config.{k}" for k in REQUIRED_HF_FIELDS[1:]))
    if "layer_types" in hf:
      layers = tuple(hf["layer_types"])
      bad = sorted({t for t in layers if t not in LAYER_TYPES})
      if bad:
        ck.fail("model.hf_config.layer_types", f"unknown layer type(s) {bad}; expected "
                f"{list(LAYER_TYPES)}")
      if len(layers) != hf["num_hidden_layers"]:
        ck.fail("model.hf_config.layer_types", f"has {len(layers)} entries but "
                f"num_hidden_layers = {hf['num_hidden_layers']}")


def _check_tokenizer(ck: _Checker) -> None:
  ck.one_of("tokenizer.source", TOKENIZER_SOURCES)
  ck.one_of("tokenizer.tool_preamble", TOOL_PREAMBLES)
  source = ck.get("tokenizer.source")
  if source == "pretrained" and not (ck.get("tokenizer.path") or ck.get("model.path")):
    ck.fail("tokenizer.path", "a pretrained tokenizer needs a directory (or model.path)")
  if source == "train":
    ck.positive("tokenizer.train.vocab_size", "tokenizer.train.corpus_tasks")
    hf = ck.get("model.hf_config")
    model_vocab, tok_vocab = hf.get("vocab_size"), ck.get("tokenizer.train.vocab_size")
    if (ck.get("model.source") in FROM_HF_CONFIG and isinstance(model_vocab, int)
        and isinstance(tok_vocab, int) and model_vocab < tok_vocab):
      ck.fail("model.hf_config.vocab_size", f"{model_vocab} is smaller than the trained "
              f"tokenizer's vocab ({tok_vocab}): token ids would fall outside the embedding")


def _check_mesh(ck: _Checker) -> None:
  sizes = [ck.get(f"mesh.{a}") for a in MESH_AXES]
  for axis, size in zip(MESH_AXES, sizes):
    if not (isinstance(size, int) and (size == -1 or size >= 1)):
      ck.fail(f"mesh.{axis}", f"must be -1 (the rest) or >= 1, got {size!r}")
  if sizes.count(-1) > 1:
    ck.fail("mesh", "at most one axis may be -1")
  for i, rule in enumerate(ck.get("sharding.rules")):
    if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
      ck.fail(f"sharding.rules[{i}]", f"must be (logical_name, mesh_axes), got {rule!r}")
      continue
    name, axes = rule   # a repeated name is a fallback: the first rule wins (flax/MaxText)
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    bad = [a for a in axes if a not in MESH_AXES]
    if bad:
      ck.fail(f"sharding.rules[{i}]", f"{name!r} maps to unknown mesh axes {bad}; expected "
              f"{list(MESH_AXES)}")


def _check_training(ck: _Checker) -> None:
  for phase in ("sft", "grpo"):
    ck.positive(f"{phase}.lr", f"{phase}.micro_batches", f"{phase}.checkpoint.every",
                f"{phase}.checkpoint.keep", f"{phase}.max_grad_norm")
    ck.that(f"{phase}.warmup_steps", lambda v: v >= 0, ">= 0")
    ck.that(f"{phase}.weight_decay", lambda v: v >= 0, ">= 0")
    ck.one_of(f"{phase}.schedule", SCHEDULES)
    ck.one_of(f"{phase}.remat", REMAT_POLICIES)
  for field in ("trainer.weight_dtype", "trainer.reference_dtype"):
    if ck.get(field) is not None:
      ck.one_of(field, DTYPES)
  ck.that("trainer.keep_rounds", lambda v: v >= 1, ">= 1 (the last round's artifacts are kept)")
  if ck.get("model.attention_impl") is not None:
    ck.one_of("model.attention_impl", ATTENTION_IMPLS)
  ck.positive("memory.device_gib")
  ck.one_of("memory.layout", MEMORY_LAYOUTS)
  for field in ("memory.rollout_reserved_gib", "memory.jax_context_gib",
                "memory.rollout_activation_gib", "memory.headroom_gib"):
    ck.that(field, lambda v: 0 <= v < ck.get("memory.device_gib"),
            ">= 0 and below memory.device_gib")
  ck.positive("sft.steps", "sft.global_batch_size", "sft.max_seq_len", "sft.num_examples")
  ck.that("sft.first_action_tasks", lambda v: isinstance(v, int) and v >= 0, "an int >= 0")
  ck.that("sft.e2e_tasks", lambda v: isinstance(v, int) and v >= 0, "an int >= 0")
  ck.that("sft.reaction_tasks", lambda v: isinstance(v, int) and v >= 0, "an int >= 0")
  ck.flag("sft.stop_rows", "sft.stage_stop_rows")
  if (ck.get("sft.stop_rows") is True and ck.get("sft.stage_stop_rows") is False
      and ck.get("rollout.stage_end") is not True):
    ck.fail("sft.stage_stop_rows", "False (no stop row after a stage-local S1-S4 focus) needs "
            "rollout.stage_end, or those stages' rollouts run on to their call limit")
  ck.that("sft.bucket_lengths", lambda v: all(isinstance(b, int) and b > 0 for b in v),
          "a tuple of ints > 0")
  ck.fraction("sft.validation_fraction")
  ck.that("sft.context_loss_weight", lambda v: isinstance(v, (int, float)) and v >= 0,
          "a number >= 0")
  ck.that("sft.decision_balance", lambda v: isinstance(v, (int, float)) and 0 <= v <= 1,
          "a number in [0, 1]")
  ck.divides("sft.global_batch_size", "sft.micro_batches")

  ck.positive("grpo.rounds", "grpo.steps_per_round", "grpo.prompt_groups",
              "grpo.logprob_chunk_size")
  ck.that("grpo.group_size", lambda v: v >= 2, ">= 2 (a group of one has zero advantage)")
  ck.one_of("grpo.advantage.mode", ADVANTAGE_ESTIMATORS)
  ck.one_of("grpo.advantage.credit", CREDIT_MODES)
  ck.that("grpo.advantage.credit_discount",
          lambda v: isinstance(v, (int, float)) and 0 <= v <= 1, "a number in [0, 1]")
  if (ck.get("grpo.advantage.credit") == "stage"
      and ck.get("workflow.action_space") != "stage_tools"):
    ck.fail("grpo.advantage.credit", "'stage' needs workflow.action_space 'stage_tools' (only "
            "its calls name the stage a turn answers for)")
  if ck.get("grpo.advantage.credit") == "stage" and ck.get("grpo.failed_call_penalty"):
    ck.fail("grpo.failed_call_penalty", "is not defined with grpo.advantage.credit 'stage' "
            "(a penalty has no stage to land on); set it to 0")
  _check_grpo_loss(ck)
  groups, size = ck.get("grpo.prompt_groups"), ck.get("grpo.group_size")
  micro = ck.get("grpo.micro_batches")
  if all(isinstance(v, int) and v > 0 for v in (groups, size, micro)) and (groups * size) % micro:
    ck.fail("grpo.micro_batches", f"{micro} does not divide the {groups * size} trajectories "
            "of an update (grpo.prompt_groups x grpo.group_size)")


def batch_layout_problems(cfg: ConfigDict, hosts: int) -> list[str]:
  """`sharding.batch_divisibility_problems` of the SFT and GRPO batches and micro-batches on the
  config's mesh over `hosts` hosts, each named by its config fields."""
  sft, grpo = cfg.sft, cfg.grpo
  rows = grpo.prompt_groups * grpo.group_size
  batches = {
      "config.sft.global_batch_size": sft.global_batch_size,
      "config.sft.global_batch_size / config.sft.micro_batches":
          sft.global_batch_size // sft.micro_batches,
      "config.grpo.prompt_groups x config.grpo.group_size": rows,
      "config.grpo.prompt_groups x config.grpo.group_size / config.grpo.micro_batches":
          rows // grpo.micro_batches}
  mesh = sharding.mesh_shape_for_hosts(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, hosts)
  return [f"{p} at hosts={hosts}" for p in
          sharding.batch_divisibility_problems(mesh, tuple(cfg.sharding.rules), batches)]


def _check_batch_layout(ck: _Checker) -> None:
  if ck.errors:  # sizes or the mesh are already wrong: their own messages say so
    return
  hosts = ck.get("distributed.num_processes") if ck.get("distributed.enabled") else 1
  ck.errors.extend(batch_layout_problems(ck.cfg, hosts or 1))


def _check_grpo_loss(ck: _Checker) -> None:
  """The loss's own checks, plus the settings the loss needs from the rest of the run."""
  ck.one_of("grpo.kl_reference", KL_REFERENCES)
  ck.one_of("grpo.old_logp", OLD_LOGP_SOURCES)
  if ck.get("grpo.loss_norm_length") is not None:
    ck.positive("grpo.loss_norm_length")
  try:  # modes from the loss's registries, clip / KL / TIS ranges
    validate_loss_config(
        norm_length=ck.get("grpo.loss_norm_length")
        or ck.get("rollout.limits.max_response_tokens"),
        **{k: ck.get(f"grpo.{k}") for k in ("kl_estimator", "loss_agg", "clip_low",
                                            "clip_high", "dual_clip", "kl_coef", "tis_cap")})
  except (ValueError, TypeError) as e:
    ck.fail("grpo", str(e))
  processes, groups = ck.get("distributed.num_processes"), ck.get("grpo.prompt_groups")
  if (ck.get("distributed.enabled") and isinstance(processes, int) and processes > 0
      and isinstance(groups, int) and groups % processes):
    ck.fail("grpo.prompt_groups", f"{groups} state_id groups do not split evenly over "
            f"distributed.num_processes = {processes} (each process rolls out whole groups)")
  engine = ck.get("rollout.engine")
  if ck.get("grpo.tis_cap") is not None and engine not in ENGINES_WITH_SAMPLER_LOGPROBS:
    ck.fail("grpo.tis_cap", f"truncated IS needs sampler logprobs, which rollout.engine "
            f"{engine!r} does not return (engines that do: {list(ENGINES_WITH_SAMPLER_LOGPROBS)})")


def _check_rollout(ck: _Checker) -> None:
  ck.one_of("rollout.engine", ROLLOUT_ENGINES)
  # Greedy (0) is fine for serving but not for GRPO, which divides logits by the temperature.
  ck.that("rollout.sampling.temperature", lambda v: v > 0, "> 0 for RL rollouts")
  ck.positive("rollout.max_concurrent_trajectories")
  ck.flag("rollout.stage_end")
  if ck.get("rollout.stage_end") is True and ck.get("workflow.action_space") != "stage_tools":
    ck.fail("rollout.stage_end", "needs workflow.action_space 'stage_tools' (only its calls "
            f"name their stage), got {ck.get('workflow.action_space')!r}")
  turns, calls = (ck.get("rollout.limits.max_assistant_turns"),
                  ck.get("rollout.limits.max_tool_calls"))
  if isinstance(turns, int) and isinstance(calls, int) and calls >= turns:
    ck.fail("rollout.limits.max_tool_calls", f"{calls} must be below max_assistant_turns "
            f"({turns}): the last turn answers the final tool observation")
  if ck.get("rollout.engine") == "jax":
    ck.positive("rollout.jax.batch_size", "rollout.jax.max_len", "rollout.jax.prefill_chunk")
    context, max_len = ck.get("rollout.limits.max_context_tokens"), ck.get("rollout.jax.max_len")
    if isinstance(context, int) and isinstance(max_len, int) and max_len < context:
      ck.fail("rollout.jax.max_len", f"{max_len} is below rollout.limits.max_context_tokens "
              f"({context}): the cache cannot hold a full trajectory")
  else:
    _check_sglang(ck)
  fraction = ck.get("distributed.xla_mem_fraction")
  if fraction is not None:
    ck.fraction("distributed.xla_mem_fraction", lo_open=True)


def _check_sglang(ck: _Checker) -> None:
  ck.positive("rollout.sglang.tp_size", "rollout.sglang.dp_size",
              "rollout.sglang.request_timeout_s", "rollout.sglang.startup_timeout_s",
              "rollout.sglang.release_timeout_s")
  ck.that("rollout.sglang.max_retries", lambda v: isinstance(v, int) and v >= 0,
          "an integer >= 0")
  ck.fraction("rollout.sglang.mem_fraction_static", lo_open=True)
  ck.that("rollout.sglang.port", lambda v: 0 <= v < 65536, "a TCP port (0: any free one)")
  ck.one_of("rollout.sglang.server_module", SERVER_MODULES)
  ck.one_of("rollout.sglang.dtype", SERVING_DTYPES)
  python = ck.get("rollout.sglang.python")
  if python is not None and not (isinstance(python, str) and python):
    ck.fail("rollout.sglang.python", f"{python!r} must be an interpreter path or None")
  export_dir = ck.get("rollout.sglang.export_dir")
  if export_dir is not None and not (isinstance(export_dir, str) and os.path.isabs(export_dir)):
    ck.fail("rollout.sglang.export_dir", f"{export_dir!r} must be an absolute path or None")
  ck.that("rollout.sglang.export_threads", lambda v: isinstance(v, int) and 1 <= v <= 64,
          "an integer in [1, 64]")
  extra = ck.get("rollout.sglang.extra_args")
  if not all(isinstance(a, str) for a in extra):
    ck.fail("rollout.sglang.extra_args", f"{extra!r} must be a list of strings")
  if ck.get("rollout.sglang.server_module") == "bat_jax.serve" and ck.get(
      "rollout.sglang.dp_size") != 1:
    ck.fail("rollout.sglang.dp_size", "bat_jax.serve runs one replica: use 1")
  if not ck.get("rollout.sglang.launch") and not ck.get("rollout.sglang.urls"):
    ck.fail("rollout.sglang.urls", "needs at least one server URL when launch is False")


def _check_services(ck: _Checker) -> None:
  for f in dataclasses.fields(SandboxLimits):  # name the field: nan / inf / <= 0 are refused
    ck.that(f"sandbox.{f.name}", lambda v: isinstance(v, (int, float)) and math.isfinite(v)
            and v > 0, "a finite number > 0")
  ck.one_of("stagebank.mode", STAGEBANK_MODES)
  ck.positive("stagebank.n_batches", "stagebank.request_timeout_s", "stagebank.workers")
  if ck.get("stagebank.mode") == "connect" and not ck.get("stagebank.dir"):
    ck.fail("stagebank.dir", "mode 'connect' needs the running Stage Bank's directory")
  ck.one_of("evaluator.kind", EVALUATOR_KINDS)
  ck.one_of("evaluator.tier", EVALUATOR_TIERS)
  ck.one_of("workflow.action_space", workflow.ACTION_SPACES)
  ck.positive("evaluator.cells_per_track", "evaluator.workers", "evaluator.external.timeout_s")
  if ck.get("evaluator.kind") == "external":
    if ck.get("evaluator.heldback_cells_per_track"):
      ck.fail("evaluator.heldback_cells_per_track", "held-back cells are the built-in "
              "evaluator's; an external benchmark holds back its own split (use 0)")
    argv = ck.get("evaluator.external.argv")
    if not argv or not all(isinstance(a, str) for a in argv):
      ck.fail("evaluator.external.argv", f"must be a non-empty list of strings, got {argv!r}")
    else:
      joined = " ".join(argv)
      missing = [p for p in EXTERNAL_PLACEHOLDERS if p not in joined]
      if missing:
        ck.fail("evaluator.external.argv", f"lacks the placeholder(s) {missing}")


INT64_MAX = 2**63 - 1


def _check_numbers(ck: _Checker, node: Any = None, path: str = "") -> None:
  """Every number in every section: floats finite, ints within int64, seeds non-negative ints.

  Generic over the whole tree (lists and tuples included), so a new field is covered without an
  edit here; the per-section checks add the field-specific ranges.
  """
  node = ck.cfg if node is None else node
  items = (node.items() if isinstance(node, (ConfigDict, dict)) else
           enumerate(node) if isinstance(node, (list, tuple)) else ())
  for key, value in items:
    child = f"{path}.{key}" if path and isinstance(key, str) else (
        f"{path}[{key}]" if path else str(key))
    if isinstance(value, (ConfigDict, dict, list, tuple)):
      _check_numbers(ck, value, child)
    elif isinstance(value, bool) or value is None:
      continue
    elif isinstance(value, float) and not math.isfinite(value):
      ck.fail(child, f"must be a finite number, got {value!r}")
    elif isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
      ck.fail(child, f"{value} is out of the int64 range")
    elif str(key).endswith("seed") and not (isinstance(value, int) and 0 <= value <= INT64_MAX):
      ck.fail(child, f"must be a non-negative integer seed, got {value!r}")


def field_problems(cfg: ConfigDict) -> list[str]:
  """Every problem the checks here find, as `config.<path>: <problem>` lines."""
  ck = _Checker(cfg)
  for section_check in (_check_numbers, _check_model, _check_tokenizer, _check_mesh,
                        _check_training, _check_rollout, _check_services, _check_batch_layout):
    try:
      section_check(ck)
    except KeyError as e:
      ck.errors.append(f"config: missing field {e}")
  # The documented range of every numeric field (bat_jax.config_bounds), for the fields that
  # the checks above did not already refuse.
  named = frozenset(e.split(":", 1)[0].removeprefix("config.") for e in ck.errors)
  return ck.errors + config_bounds.bound_problems(cfg, skip=named)


def typed_sections(cfg: ConfigDict) -> dict[str, Any]:
  """Every check here, then the sections the code owns a dataclass for, built (their own
  checks refuse bad values): dotted section path -> SamplingParams, RolloutLimits,
  SandboxLimits, CurriculumConfig, GateThresholds, EvalSettings (and ExternalEvaluator).

  Raises:
    ConfigError: listing every invalid field as `config.<path>: <problem>`.
  """
  errors = field_problems(cfg)
  typed: dict[str, Any] = {}

  def build(path: str, make: Callable[[], Any]) -> None:
    try:
      typed[path] = make()
    except (ValueError, TypeError) as e:
      message = str(e)  # the section parsers already start with their path
      errors.append(f"config.{message}" if message.startswith(path + ".") or
                    message.startswith(path + ":") else f"config.{path}: {message}")
    except KeyError as e:
      errors.append(f"config: missing field {e}")

  build("rollout.sampling", lambda: SamplingParams(**cfg.rollout.sampling.to_dict()))
  build("rollout.limits", lambda: RolloutLimits(**cfg.rollout.limits.to_dict()))
  build("sandbox", lambda: SandboxLimits(**cfg.sandbox.to_dict()))
  build("curriculum", lambda: CurriculumConfig.from_config(cfg.curriculum))
  build("gate", lambda: GateThresholds.from_config(cfg.gate))
  if not errors:  # built from fields checked above
    if cfg.evaluator.kind == "external":
      build("evaluator.external", lambda: ExternalEvaluator(
          argv=tuple(cfg.evaluator.external.argv),
          timeout_s=float(cfg.evaluator.external.timeout_s)))
    build("evaluator", lambda: EvalSettings(
        tier=cfg.evaluator.tier, seed=int(cfg.evaluator.seed),
        cells_per_track=int(cfg.evaluator.cells_per_track), limits=typed["rollout.limits"],
        sandbox_limits=typed["sandbox"], action_space=cfg.workflow.action_space))
  if errors:
    raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
  return typed


def validate_config(cfg: ConfigDict) -> None:
  """Checks every section of a run config: what `RunConfig.from_config` checks.

  Raises:
    ConfigError: listing every invalid field as `config.<path>: <problem>`.
  """
  typed_sections(cfg)
