"""The import graph, in-function imports included: no cycles, no private names across layers."""

from __future__ import annotations

import ast
import pathlib

import flaxlens

PACKAGE = pathlib.Path(flaxlens.__file__).parent
LAYERS = ("core", "linen", "nnx", "tools")


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in PACKAGE.rglob("*.py"):
    parts = ("flaxlens", *path.relative_to(PACKAGE).with_suffix("").parts)
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    found[name] = path
  return found


def _layer(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 2 and parts[1] in LAYERS else None


def _imports(modules: dict[str, pathlib.Path]) -> list[tuple[str, str, str]]:
  """`(importer, imported module, imported name)` for every flaxlens import, anywhere."""
  found = []
  for name, path in modules.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flaxlens"):
        for alias in node.names:
          full = f"{node.module}.{alias.name}"
          found.append((name, full if full in modules else node.module, alias.name))
      elif isinstance(node, ast.Import):
        found += [(name, a.name, "") for a in node.names if a.name.startswith("flaxlens")]
  return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of `graph`, or None."""
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(module: str) -> list[str] | None:
    state[module] = 1
    stack.append(module)
    for dep in sorted(graph.get(module, ())):
      if state.get(dep) == 1:
        return stack[stack.index(dep) :] + [dep]
      if dep not in state and (found := visit(dep)):
        return found
    stack.pop()
    state[module] = 2
    return None

  for module in sorted(graph):
    if module not in state and (found := visit(module)):
      return found
  return None


def test_no_module_of_the_package_imports_itself_through_a_cycle():
  modules = _modules()
  graph: dict[str, set[str]] = {}
  for importer, imported, _ in _imports(modules):
    if imported in modules and imported != importer:
      graph.setdefault(importer, set()).add(imported)
  assert _cycle(graph) is None


def test_no_private_name_is_imported_across_core_linen_nnx_and_tools():
  crossing = [
    (importer, f"{imported}.{name}")
    for importer, imported, name in _imports(_modules())
    if name.startswith("_")
    and _layer(importer) is not None
    and _layer(imported) is not None
    and _layer(importer) != _layer(imported)
  ]
  assert crossing == []


def test_core_imports_no_framework_and_tools_import_no_framework_package():
  wrong = [
    (importer, imported)
    for importer, imported, _ in _imports(_modules())
    if (_layer(importer) == "core" and _layer(imported) in ("linen", "nnx", "tools"))
    or (_layer(importer) == "tools" and _layer(imported) in ("linen", "nnx"))
  ]
  assert wrong == []
