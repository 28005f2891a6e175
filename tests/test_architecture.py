"""The package's layers, read from its import statements: no cycles, no leaks between layers.

Every module under flaxlens/ is parsed (not imported) and every import statement in it is
read, at the top level and inside functions alike: `import a.b`, `from a import b`, and
relative imports resolved against the importing module's package. The layers are the
packages `core`, `linen`, `nnx` and `tools`, and the root (the modules directly in
flaxlens/). The rules:

- No import cycle between flaxlens modules. An import points at the module it loads:
  `from flaxlens.core import _calls` at `flaxlens.core._calls`, `from flaxlens.core
  import Layer` at `flaxlens.core` (its `__init__`). A package's `__init__`, which Python
  runs before any of its submodules, counts only where a module imports from it by name.
  One cycle is reported per set of modules that import each other.
- No private name crosses between `core`, `linen`, `nnx` and the jobs of `tools`
  (`tools.analysis`, `tools.files`, ...). A private name
  starts with one underscore and is not a module: `from flaxlens.core._calls import
  _gather` and `_calls._gather` (an attribute of an imported module) cross when the two
  modules are in different packages; `from flaxlens.core import _calls` (a private module
  of another package, for its public names) and `from flaxlens.core._calls import gather`
  do not. Attributes of objects (`node._private()`) are the next rule's.
- No private attribute is reached across those units either: `x._name` (one underscore,
  not `self._name` or `cls._name`) in a module of one unit, where flaxlens defines
  `_name` on a class (a method, a class attribute or field, `self._name = ...`, a
  `setattr(obj, "_name", ...)`) only in modules of other units. Only names flaxlens
  defines count: `module._state` of a Flax module is not ours. A private module-level
  name reached as an attribute of its module (`_calls._gather`) is the import rule's; such
  names are not counted here, since an object that is not a module cannot hold them (Flax's
  `module._state` and a NamedTuple's `site._replace` share their names with module-level
  functions of flaxlens).
- `core` and `tools` are framework-neutral: nothing in them imports from `linen` or
  `nnx`. The composition root (`flaxlens/__init__.py`, `flaxlens/_unflaxify.py`) may.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

SOURCE = pathlib.Path(__file__).resolve().parents[1] / "flaxlens"
PACKAGES = ("core", "linen", "nnx", "tools")
NEUTRAL = ("core", "tools")
ADAPTERS = ("linen", "nnx")


@dataclasses.dataclass(frozen=True)
class Import:
  """`importer` (line `line`) takes `name` from `module`; `name` None: the module itself."""

  importer: str
  module: str
  name: str | None
  line: int

  def __str__(self) -> str:
    taken = self.module if self.name is None else f"{self.module}.{self.name}"
    return f"{self.importer}:{self.line} imports {taken}"


def _module_names(source: pathlib.Path) -> dict[str, pathlib.Path]:
  modules = {}
  for path in sorted(source.rglob("*.py")):
    parts = path.relative_to(source.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    modules[".".join(parts)] = path
  return modules


def _package_of(module: str, path: pathlib.Path) -> str:
  """The package a relative import in `module` starts from."""
  return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports_of(module: str, path: pathlib.Path, modules: set[str]) -> list[Import]:
  tree = ast.parse(path.read_text(), str(path))
  found: list[Import] = []
  aliases: dict[str, str] = {}  # a local name bound to a flaxlens module
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name in modules:
          found.append(Import(module, alias.name, None, node.lineno))
          aliases[alias.asname or alias.name] = alias.name
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        package = _package_of(module, path).split(".")
        anchor = ".".join(package[: len(package) - node.level + 1])
        base = f"{anchor}.{base}" if base else anchor
      if base not in modules:
        continue
      for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in modules:
          found.append(Import(module, submodule, None, node.lineno))
          aliases[alias.asname or alias.name] = submodule
        else:
          found.append(Import(module, base, alias.name, node.lineno))
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in aliases
      and f"{aliases[node.value.id]}.{node.attr}" not in modules
    ):
      found.append(Import(module, aliases[node.value.id], node.attr, node.lineno))
  return found


def read_imports(source: pathlib.Path) -> dict[str, list[Import]]:
  """Each module of the package at `source`, with its imports of the package's modules."""
  modules = _module_names(source)
  return {module: _imports_of(module, path, set(modules)) for module, path in modules.items()}


def _layer(module: str) -> str:
  """ "core", "linen", "nnx", "tools", or "root" for the modules directly in flaxlens/."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "root"


def _unit(module: str) -> str:
  """The package a private name may not leave: a layer, or one job of `tools`
  (`tools.analysis`, `tools.files`, ...)."""
  layer = _layer(module)
  parts = module.split(".")
  if layer == "tools" and len(parts) > 3:
    return f"tools.{parts[2]}"
  return layer


def _all(imports: dict[str, list[Import]]) -> list[Import]:
  return [i for found in imports.values() for i in found]


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
  """Tarjan's strongly connected components, each sorted."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  components = []

  def visit(module):
    index[module] = low[module] = len(index)
    stack.append(module)
    for target in sorted(graph[module]):
      if target not in index:
        visit(target)
        low[module] = min(low[module], low[target])
      elif target in stack:
        low[module] = min(low[module], index[target])
    if low[module] == index[module]:
      component = []
      while not component or component[-1] != module:
        component.append(stack.pop())
      components.append(sorted(component))

  for module in sorted(graph):
    if module not in index:
      visit(module)
  return components


def _shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
  paths = {start: [start]}
  frontier = [start]
  while frontier:
    next_frontier = []
    for module in frontier:
      for target in sorted(graph[module] & within):
        if target == start:
          return paths[module] + [start]
        if target not in paths:
          paths[target] = paths[module] + [target]
          next_frontier.append(target)
    frontier = next_frontier
  raise AssertionError(f"{start} is on no cycle")


def import_cycles(imports: dict[str, list[Import]]) -> list[list[str]]:
  """One cycle through each set of modules that import each other, first module repeated."""
  graph = {module: {i.module for i in found} for module, found in imports.items()}
  return [
    _shortest_cycle(graph, component[0], set(component))
    for component in _strongly_connected(graph)
    if len(component) > 1 or component[0] in graph[component[0]]
  ]


def private_names_across_packages(imports: dict[str, list[Import]]) -> list[Import]:
  return [
    i
    for i in _all(imports)
    if i.name is not None
    and i.name.startswith("_")
    and not i.name.startswith("__")
    and _layer(i.importer) in PACKAGES
    and _layer(i.module) in PACKAGES
    and _unit(i.importer) != _unit(i.module)
  ]


@dataclasses.dataclass(frozen=True)
class Access:
  """`module` (line `line`) reads `text` (`node._mask`), whose attribute flaxlens defines
  only in the units `owners`."""

  module: str
  line: int
  text: str
  owners: tuple[str, ...]

  def __str__(self) -> str:
    return f"{self.module}:{self.line} reads {self.text}, defined only in {', '.join(self.owners)}"


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def _on_self(node: ast.AST) -> bool:
  return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _class_attributes(tree: ast.Module) -> set[str]:
  """The private attributes a module defines on classes and instances."""
  found: set[str] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ClassDef):
      for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
          found.add(item.name)
        targets = item.targets if isinstance(item, ast.Assign) else []
        targets += [item.target] if isinstance(item, ast.AnnAssign) else []
        found.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      found.update(
        n.attr
        for t in targets
        for n in ast.walk(t)
        if isinstance(n, ast.Attribute) and _on_self(n.value)
      )
    elif isinstance(node, ast.Call) and len(node.args) >= 2:
      setter = node.func
      named = node.args[1]
      if (
        (isinstance(setter, ast.Name) and setter.id == "setattr")
        or (isinstance(setter, ast.Attribute) and setter.attr == "__setattr__")
      ) and isinstance(named, ast.Constant):
        found.add(named.value)
  return {name for name in found if isinstance(name, str) and _private(name)}


def private_attributes_across_packages(source: pathlib.Path) -> list[Access]:
  """Each `x._name` read in one unit whose attribute flaxlens defines only in others."""
  trees = {m: ast.parse(p.read_text(), str(p)) for m, p in _module_names(source).items()}
  owners: dict[str, set[str]] = {}
  for module, tree in trees.items():
    for name in _class_attributes(tree):
      owners.setdefault(name, set()).add(_unit(module))
  found = []
  for module, tree in trees.items():
    for node in ast.walk(tree):
      if not isinstance(node, ast.Attribute) or _on_self(node.value):
        continue
      units = owners.get(node.attr, set())
      if _private(node.attr) and units and _unit(module) not in units:
        access = Access(module, node.lineno, ast.unparse(node), tuple(sorted(units)))
        found.append(((module, node.lineno, node.col_offset), access))
  return [access for _, access in sorted(found, key=lambda item: item[0])]


def adapters_imported_by_neutral_layers(imports: dict[str, list[Import]]) -> list[Import]:
  return [
    i for i in _all(imports) if _layer(i.importer) in NEUTRAL and _layer(i.module) in ADAPTERS
  ]


@pytest.fixture(scope="module")
def imports() -> dict[str, list[Import]]:
  return read_imports(SOURCE)


def test_every_module_and_its_imports_are_read(imports):
  expected = {
    "flaxlens",
    "flaxlens.core",
    "flaxlens.core._calls",
    "flaxlens.tools.isolation._isolate",
  }
  assert expected <= set(imports)
  assert imports["flaxlens.tools.isolation._isolate"]


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
  for name, text in files.items():
    path = root / "flaxlens" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return root / "flaxlens"


def test_each_rule_finds_its_violation_in_a_package_that_breaks_it(tmp_path):
  """An in-function relative import closing a cycle, private names taken two ways."""
  source = _write(
    tmp_path,
    {
      "__init__.py": "",
      "core/__init__.py": "",
      "core/_a.py": "def f():\n  from ..tools import _b\n  from flaxlens.linen._x import _p\n",
      "tools/__init__.py": "",
      "tools/_b.py": "from flaxlens.core import _a\nuse = _a._hidden, _a.public\n",
      "linen/__init__.py": "",
      "linen/_x.py": "_p = 1\n",
    },
  )
  imports = read_imports(source)
  assert import_cycles(imports) == [["flaxlens.core._a", "flaxlens.tools._b", "flaxlens.core._a"]]
  assert list(map(str, private_names_across_packages(imports))) == [
    "flaxlens.core._a:3 imports flaxlens.linen._x._p",
    "flaxlens.tools._b:2 imports flaxlens.core._a._hidden",
  ]
  assert list(map(str, adapters_imported_by_neutral_layers(imports))) == [
    "flaxlens.core._a:3 imports flaxlens.linen._x._p"
  ]


def test_the_attribute_rule_finds_private_attributes_read_across_units(tmp_path):
  """Methods, class attributes, `self._x =` and `setattr` define; reads on `self`, of
  names the reader's unit also defines, or of names flaxlens never defines, pass."""
  source = _write(
    tmp_path,
    {
      "__init__.py": "",
      "core/__init__.py": "",
      "core/_a.py": (
        "class Node:\n"
        "  _kind = 'call'\n"
        "  def __init__(self):\n"
        "    self._slot = 1\n"
        "    object.__setattr__(self, '_frozen', 2)\n"
        "  def _spec(self):\n"
        "    return self._slot, self._kind\n"
        "  def _shared(self):\n"
        "    return 0\n"
        "def _helper(node):\n"
        "  return node._external\n"
      ),
      "tools/__init__.py": "",
      "tools/job/__init__.py": "",
      "tools/job/_b.py": (
        "class Tool:\n"
        "  def _shared(self):\n"
        "    return self._own\n"
        "def use(node, module):\n"
        "  return (node._spec(), node._slot, node._kind, node._frozen, node._shared(),\n"
        "          module._state, module._helper, node.__dict__)\n"
      ),
    },
  )
  assert list(map(str, private_attributes_across_packages(source))) == [
    "flaxlens.tools.job._b:5 reads node._spec, defined only in core",
    "flaxlens.tools.job._b:5 reads node._slot, defined only in core",
    "flaxlens.tools.job._b:5 reads node._kind, defined only in core",
    "flaxlens.tools.job._b:5 reads node._frozen, defined only in core",
  ]


# `node._call_spec` is replaced by the probes branch.
ALLOWED_PRIVATE_ATTRIBUTES = {("flaxlens.tools.analysis._interventions", "_call_spec")}


def test_no_private_attribute_is_read_across_core_linen_nnx_root_and_tools_jobs():
  found = [
    access
    for access in private_attributes_across_packages(SOURCE)
    if (access.module, access.text.rpartition(".")[2]) not in ALLOWED_PRIVATE_ATTRIBUTES
  ]
  assert not found, "private attributes across units:\n" + "\n".join(map(str, found))


def test_no_import_cycle_between_flaxlens_modules(imports):
  cycles = import_cycles(imports)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_name_is_imported_across_core_linen_nnx_and_tools(imports):
  found = private_names_across_packages(imports)
  assert not found, "private names across packages:\n" + "\n".join(map(str, found))


def test_core_and_tools_do_not_import_the_framework_adapters(imports):
  found = adapters_imported_by_neutral_layers(imports)
  assert not found, "core/ or tools/ importing linen/ or nnx/:\n" + "\n".join(map(str, found))
