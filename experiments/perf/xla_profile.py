"""Per-op time of a compiled JAX function, attributed to the source line that emitted each op.

`jax.profiler` records one event per XLA op (fusion / thunk) on the CPU or GPU; the compiled HLO
maps each op to its stack frame (FileNames / FileLocations / StackFrames tables), so op time can
be summed per innermost `bat_jax` frame: "deltanet.py:gated_delta_rule_chunked:143" instead of
"copy_bitcast_fusion.20".
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
from typing import Callable

import jax

_TABLE = re.compile(r"^(\d+) (.*)$")
_CONTAINER = re.compile(r"\} (?:while|conditional|call)\(|\) (?:while|conditional|call)\(|^\S+ (?:while|conditional|call)\(")


def _tables(hlo: str) -> dict[str, dict[int, str]]:
  tables: dict[str, dict[int, str]] = {}
  current = None
  for line in hlo.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = tables.setdefault(line, {})
    elif current is not None and (m := _TABLE.match(line)):
      current[int(m.group(1))] = m.group(2)
    elif current is not None and line and not line[0].isdigit():
      current = None
  return tables


def op_sources(hlo: str, keep: str = "bat_jax/") -> dict[str, str]:
  """HLO op name -> "file:function:line" of its innermost frame under `keep`."""
  t = _tables(hlo)
  files = {k: v.strip('"') for k, v in t.get("FileNames", {}).items()}
  funcs = {k: v.strip('"') for k, v in t.get("FunctionNames", {}).items()}
  locs = {}
  for k, v in t.get("FileLocations", {}).items():
    f = dict(re.findall(r"(\w+)=(\d+)", v))
    locs[k] = (files.get(int(f["file_name_id"]), "?"), funcs.get(int(f["function_name_id"]), "?"),
               int(f["line"]))
  frames = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in t.get("StackFrames", {}).items()}

  def describe(frame_id: int) -> str:
    seen = set()
    while frame_id in frames and frame_id not in seen:
      seen.add(frame_id)
      file, func, line = locs[int(frames[frame_id]["file_location_id"])]
      if keep in file:
        return f"{file.split(keep)[-1]}:{func}:{line}"
      parent = int(frames[frame_id]["parent_frame_id"])
      frame_id = parent if parent != frame_id else -1
    return "other"

  out = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?)stack_frame_id=(\d+)", hlo, re.M):
    if not _CONTAINER.search(m.group(2)):  # a loop's event spans its body's ops: not counted
      out[m.group(1)] = describe(int(m.group(3)))
  return out


def profile(compiled, run: Callable[[], object], iters: int = 2, top: int = 20) -> list[str]:
  """Runs `run` `iters` times under the profiler; returns report lines: ms per step by source
  line (top `top`) and by file."""
  sources = op_sources(compiled.as_text())
  trace_dir = tempfile.mkdtemp(prefix="xla_profile_")
  with jax.profiler.trace(trace_dir):
    for _ in range(iters):
      jax.block_until_ready(run())
  path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
  by_line: collections.Counter = collections.Counter()
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    for line in plane.lines:
      for event in line.events:
        if event.name in sources:
          by_line[sources[event.name]] += event.duration_ns / 1e6 / iters
  by_file: collections.Counter = collections.Counter()
  for src, ms in by_line.items():
    by_file[src.split(":")[0]] += ms
  lines = [f"op time per step: {sum(by_line.values()):.1f} ms (all threads)"]
  lines += [f"  {ms:8.1f} ms  {name}" for name, ms in by_file.most_common()]
  lines += ["top source lines:"] + [f"  {ms:8.1f} ms  {name}" for name, ms in by_line.most_common(top)]
  return lines
