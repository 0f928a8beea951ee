"""Non-finite floats and out-of-range ints anywhere in a run config are refused, naming the field.

Generic: every float and int field of the tiny config is tried, not a hand-picked list."""

import math

import pytest
from absl import flags
from ml_collections import ConfigDict, config_flags

from bat_jax.config_validation import ConfigError, validate_config
from configs import tiny

CONFIG_FILE = "configs/tiny.py"


def _numeric_fields(node, path=""):
  """Dotted paths of every int / float leaf (bools excluded)."""
  for key, value in node.items():
    child = f"{path}.{key}" if path else key
    if isinstance(value, ConfigDict):
      yield from _numeric_fields(value, child)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield child, type(value)


def _set(cfg, path, value):
  *parents, leaf = path.split(".")
  node = cfg
  for p in parents:
    node = node[p]
  node[leaf] = value


FIELDS = sorted(_numeric_fields(tiny.get_config()))
FLOAT_FIELDS = [p for p, t in FIELDS if t is float]
INT_FIELDS = [p for p, t in FIELDS if t is int]
SEED_FIELDS = [p for p in INT_FIELDS if p.endswith("seed")]


def _refused(path, value):
  cfg = tiny.get_config()
  _set(cfg, path, value)
  with pytest.raises(ConfigError, match=f"config.{path}: "):
    validate_config(cfg)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("path", FLOAT_FIELDS)
def test_non_finite_float_is_refused_naming_the_field(path, value):
  _refused(path, value)


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**23])
@pytest.mark.parametrize("path", INT_FIELDS)
def test_out_of_range_int_is_refused_naming_the_field(path, value):
  _refused(path, value)


@pytest.mark.parametrize("path", SEED_FIELDS)
def test_negative_seed_is_refused(path):
  _refused(path, -1)


def test_the_listed_cases_and_a_clean_config():
  assert len(FLOAT_FIELDS) >= 20 and len(INT_FIELDS) >= 20 and "seed" in SEED_FIELDS
  validate_config(tiny.get_config())  # the generic check refuses nothing legitimate
  for path, value in (("grpo.lr", math.inf), ("grpo.kl_coef", math.nan),
                      ("sandbox.wall_s", math.nan), ("sandbox.wall_s", math.inf),
                      ("seed", 10**23)):
    _refused(path, value)


@pytest.mark.parametrize("arg,field", [("--config.grpo.lr=inf", "grpo.lr"),
                                       ("--config.grpo.kl_coef=nan", "grpo.kl_coef"),
                                       ("--config.sandbox.wall_s=-inf", "sandbox.wall_s"),
                                       ("--config.seed=1e23", "seed")])
def test_command_line_values_are_refused_or_rejected_by_the_parser(arg, field):
  """What launch.py sees: the flag parser refuses it outright, or validation names the field."""
  argv = ["launch.py", f"--config={CONFIG_FILE}", arg]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "run config", flag_values=values,
                                  lock_config=True, sys_argv=argv)
  try:
    values(argv)
  except flags.Error as e:
    assert field.split(".")[-1] in str(e) or "config" in str(e)
    return
  with pytest.raises(ConfigError, match=f"config.{field}: "):
    validate_config(values.config)


# --- documented ranges (bat_jax.config_bounds) ---------------------------------------------------

from bat_jax import config_bounds  # noqa: E402
from configs import base, bat4b, bat9b  # noqa: E402

CONFIG_MODULES = (base, tiny, bat4b, bat9b)


_bound = config_bounds.bound_for


@pytest.mark.parametrize("module", CONFIG_MODULES, ids=lambda m: m.__name__)
def test_every_numeric_field_of_every_config_has_a_documented_range(module):
  cfg = module.get_config()
  leaves = list(config_bounds.numeric_leaves(cfg))
  assert len(leaves) >= 60
  missing = [p for p, _ in leaves if _bound(p) is None]
  assert missing == [], f"add these to bat_jax/config_bounds.BOUNDS: {missing}"
  outside = [(p, v) for p, v in leaves if v is not None and not _bound(p).contains(v)]
  assert outside == []  # the shipped values are inside their own ranges
  for path, bound in config_bounds.BOUNDS.items():
    assert bound.why and (bound.lo is not None or bound.hi is not None), path


def _just_outside(bound, kind):
  """Values just past each finite end of `bound`, of the field's type."""
  out = []
  for end, sign, is_open in ((bound.lo, -1, bound.lo_open), (bound.hi, 1, bound.hi_open)):
    if end is None:
      continue
    if kind is int:
      value = int(end) if is_open else int(end) + sign
    else:
      value = float(end) if is_open else float(end) + sign * max(abs(end) * 1e-3, 1e-9)
    if abs(value) <= config_bounds.INT63:
      out.append(value)
  return out


TINY_BOUNDED = [(p, type(v)) for p, v in config_bounds.numeric_leaves(tiny.get_config())
                if v is not None and "[" not in p]


@pytest.mark.parametrize("path,kind", TINY_BOUNDED)
def test_a_value_just_outside_the_range_is_refused_naming_the_field(path, kind):
  for value in _just_outside(_bound(path), kind):
    _refused(path, value)


@pytest.mark.parametrize("path,value", [
    ("sandbox.memory_mb", 2**50), ("sandbox.max_workspace_mb", 2**50),
    ("sandbox.max_output_bytes", 2**50), ("sandbox.memory_mb", 2**62),
    ("sandbox.wall_s", 1e300), ("logging.log_every_steps", 0),
    ("sft.max_validation_examples", -1), ("rollout.sglang.max_retries", -3),
])
def test_the_absurd_values_of_issue_24_are_refused(path, value):
  cfg = tiny.get_config()
  _set(cfg, path, value)
  with pytest.raises(ConfigError) as e:
    validate_config(cfg)
  lines = [l.strip() for l in str(e.value).splitlines()[1:]]
  assert [l for l in lines if l.startswith(f"config.{path}: ")], lines
  assert "valid range" in str(e.value) or "must be" in str(e.value)


def test_the_range_table_is_printable_for_the_readme():
  table = config_bounds.markdown_table()
  assert "| `sandbox.memory_mb` | [1, 1048576] |" in table
  assert table.count("\n") == len(config_bounds.BOUNDS) + 1


def test_stage_end_needs_the_stage_tools_action_space():
  """`rollout.stage_end` reads a call's stage from its stage command, which only the stage-tools
  action space has: with `code` it would never end a row, so the config is refused."""
  cfg = tiny.get_config()
  cfg.workflow.action_space = "code"
  with pytest.raises(ConfigError, match="config.rollout.stage_end: needs workflow.action_space"):
    validate_config(cfg)
  cfg.rollout.stage_end = False
  # ... and without it a stage-local S1-S4 row must keep its stop row.
  with pytest.raises(ConfigError, match="config.sft.stage_stop_rows: False .* needs rollout"):
    validate_config(cfg)
  cfg.sft.stage_stop_rows = True
  validate_config(cfg)


def test_stage_credit_and_decision_balance_are_checked():
  """Per-stage credit reads a turn's stage from its stage-tools call and has no stage for a
  failed-call penalty; the SFT balance exponent is bounded."""
  cfg = tiny.get_config()
  cfg.grpo.advantage.credit = "stage"
  validate_config(cfg)
  cfg.grpo.failed_call_penalty = 0.1
  with pytest.raises(ConfigError, match="config.grpo.failed_call_penalty: is not defined"):
    validate_config(cfg)
  cfg.grpo.failed_call_penalty = 0.0
  cfg.grpo.advantage.credit = "turn"
  with pytest.raises(ConfigError, match=r"config.grpo.advantage.credit: 'turn' is not one of"):
    validate_config(cfg)
  cfg.grpo.advantage.credit = "stage"
  cfg.grpo.advantage.credit_discount = 1.5
  with pytest.raises(ConfigError, match="config.grpo.advantage.credit_discount"):
    validate_config(cfg)
  cfg.grpo.advantage.credit_discount = 0.0
  cfg.workflow.action_space, cfg.rollout.stage_end, cfg.sft.stage_stop_rows = "code", False, True
  with pytest.raises(ConfigError, match="config.grpo.advantage.credit: 'stage' needs"):
    validate_config(cfg)
  cfg = tiny.get_config()
  cfg.sft.decision_balance = -0.5
  with pytest.raises(ConfigError, match="config.sft.decision_balance"):
    validate_config(cfg)
