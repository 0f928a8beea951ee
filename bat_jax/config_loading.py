"""Loading a run config from the command line, with one-line errors for the common mistakes.

`launch.py --config=FILE[:ARG] --config.a.b=v ...` and `experiments/sweep.py` both load configs
through here, so a misspelt field (`--config.grpo.lrr=1e-6`), a value of the wrong type, a
missing config file or a bad config-file argument reads the same everywhere: one line naming
the flag at fault, never a traceback. `bat_jax.config_validation` then checks every value.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from absl import flags
from ml_collections import ConfigDict, config_flags


class ConfigLoadError(ValueError):
  """The config file or an override cannot be loaded; the message is one line naming it."""


# What ml_collections raises for a field the locked config lacks: KeyError / AttributeError
# whose text is "'lrr'\nDid you mean "lr" instead of "lrr"?" (the hint only when one is close).
_MISSING = re.compile(r"""['"]?\\?'(?P<key>[^'\\]+)\\?'""")
_HINT = re.compile(r'Did you mean "(?P<hint>[^"]+)"')


def _overrides(argv: Sequence[str], flag: str) -> list[str]:
  return [a for a in argv if a.startswith(f"--{flag}.")]


def _missing_field_line(error: Exception, argv: Sequence[str], flag: str) -> Optional[str]:
  """`--config.grpo.lrr=1e-6: no config field 'lrr' (did you mean "lr"?)`, or None."""
  text = str(error.args[0]) if error.args else str(error)
  key = _MISSING.search(text)
  if key is None:
    return None
  name = key.group("key")
  culprit = next((a for a in _overrides(argv, flag)
                  if name in a.partition("=")[0].split(".")[1:]), None)
  hint = _HINT.search(text)
  where = culprit or f"--{flag}"
  return (f"{where}: no config field {name!r}"
          + (f' (did you mean "{hint.group("hint")}"?)' if hint else ""))


def one_line(error: Exception, argv: Sequence[str], flag: str = "config") -> str:
  """The one-line message for an error raised while parsing `argv`'s config flags."""
  if isinstance(error, (KeyError, AttributeError)):
    line = _missing_field_line(error, argv, flag)
    if line:
      return line
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  # A config file's own exception comes back as its traceback's text: keep its last line.
  from_file = any(line.startswith("Traceback") for line in lines)
  text = lines[-1] if from_file else " ".join(lines)
  file_arg = next((a for a in argv if a.startswith(f"--{flag}=")), f"--{flag}")
  if "No such file or directory" in text or "not available because of an earlier" in text:
    path = file_arg.partition("=")[2].partition(":")[0]
    if path and not Path(path).is_file():
      return f"{file_arg}: no such config file {path!r}"
  if isinstance(error, flags.Error) and not from_file:
    # absl: "flag --config.x=v: <why>"; a missing required flag names itself.
    return text
  return f"{file_arg}: {text}"


def parse_flags(values: flags.FlagValues, argv: Sequence[str],
                config_holder: Optional[config_flags._ConfigFlag] = None,
                flag: str = "config") -> list[str]:
  """`values(argv)` and, if given, loads the config now (lazily loaded files fail on first
  access), turning every parse error into a `ConfigLoadError` with one line."""
  try:
    rest = values(list(argv))
    if config_holder is not None:
      config_holder.value.keys()  # a file that failed to load raises on first use
  except (flags.Error, KeyError, AttributeError, OSError, ValueError, TypeError,
          SyntaxError, ImportError) as e:
    raise ConfigLoadError(one_line(e, argv, flag)) from None
  return rest


def load_config(config: str, overrides: Sequence[str] = ()) -> ConfigDict:
  """The locked ConfigDict `launch.py --config=CONFIG OVERRIDES...` would run (not validated).

  Args:
    config: a config file argument, `configs/tiny.py[:arg]`.
    overrides: `--config.a.b=v` flags.

  Raises:
    ConfigLoadError: one line naming the flag at fault.
  """
  argv = ["launch.py", f"--config={config}", *overrides]
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, "run config", flag_values=values,
                                           lock_config=True, sys_argv=argv)
  parse_flags(values, argv, holder)
  return values.config


def directory_problem(path: str | os.PathLike, flag: str = "--workdir") -> Optional[str]:
  """Why `path` cannot be a run directory (exists as a file, not writable, or a parent that
  is missing and cannot be created), as one line naming `flag`; None when it can be."""
  path = Path(path).absolute()
  if path.exists() and not path.is_dir():
    return f"{flag}={path}: exists and is not a directory"
  existing = path
  while not existing.exists():
    existing = existing.parent
  if not existing.is_dir():
    return f"{flag}={path}: cannot be created, {existing} is not a directory"
  # os.access answers for the real uid and ignores read-only mounts; a probe file does not.
  try:
    fd, probe = _probe(existing)
  except OSError as e:
    what = "is not writable" if existing == path else f"cannot be created in {existing}"
    return f"{flag}={path}: {what} ({e.strerror})"
  os.close(fd)
  os.unlink(probe)
  return None


def _probe(directory: Path) -> tuple[int, str]:
  return tempfile.mkstemp(prefix=".write-probe-", dir=directory)
