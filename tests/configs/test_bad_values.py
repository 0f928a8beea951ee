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
