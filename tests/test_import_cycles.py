"""No import cycles among bat_jax modules, counting imports inside functions too.

A cycle hidden behind a function-level import still couples both modules (each needs the other
to work) and breaks as soon as someone moves the import to the top; the graph here is built with
`ast` over every module of the package, so it sees them all.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "bat_jax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str, modules: set[str]) -> set[str]:
  """The bat_jax modules `path` imports anywhere (a `from pkg import mod` counts as `pkg.mod`)."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out: set[str] = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name in modules)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{anchor}.{base}" if base else anchor
      for alias in node.names:
        full = f"{base}.{alias.name}"
        out.add(full if full in modules else base)
  return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
  files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  modules = set(files)
  return {name: _imports(path, name, modules) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
  state: dict[str, int] = {}
  for root in sorted(graph):
    if state.get(root):
      continue
    stack = [(root, iter(sorted(graph[root])))]
    path = [root]
    state[root] = 1
    while stack:
      node, children = stack[-1]
      child = next(children, None)
      if child is None:
        state[node] = 2
        stack.pop()
        path.pop()
      elif state.get(child) == 1:
        return path[path.index(child):] + [child]
      elif not state.get(child):
        state[child] = 1
        path.append(child)
        stack.append((child, iter(sorted(graph[child]))))
  return None


def _is_package_init_edge(a: str, b: str) -> bool:
  """`pkg/__init__.py` re-exporting its own submodule is not a circle between modules."""
  return b.startswith(a + ".") or a.startswith(b + ".")


def test_bat_jax_has_no_import_cycle():
  graph = import_graph()
  assert len(graph) > 100 and "bat_jax.run_config" in graph
  pruned = {m: {d for d in deps if not _is_package_init_edge(m, d)} for m, deps in graph.items()}
  cycle = find_cycle(pruned)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph, cyclic", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"a2"}, "a2": set(), "x": {"y"}, "y": {"x"}}, True),
])
def test_find_cycle_finds_what_it_should(graph, cyclic):
  assert (find_cycle(graph) is not None) == cyclic
