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
- No Flax or JAX internal is imported outside `flaxlens/_compat/`: no `flax`/`jax` path
  with a component starting with `_` (`jax._src...`, `from flax... import _name`), no
  module but those in `PUBLIC_MODULES` (`flax.nnx.graphlib`, `from flax.nnx import
  graphlib`, `from flax.nnx.nn import attention`: which names are modules is read from
  the installed Flax and JAX), and no such path reached as an attribute of an imported
  Flax or JAX name (`nnx.graph.flatten`, `nn._x`). Inside `flaxlens/_compat/` an
  internal is not imported either: it is named as data (`Internal("flax.nnx.graphlib",
  "flatten")`) and looked up on first use, so importing flaxlens never fails on one; and
  only `_compat` makes `Internal`s.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import pathlib
import types
import warnings

import pytest

# The Flax and JAX modules whose names are public API: the packages Flax's API reference
# documents (with `flax.core`'s `frozen_dict` and `meta`, whose classes it documents;
# `flax.linen` re-exports `meta`), and JAX's public modules less `jax.extend` (no
# compatibility promise) and `jax.interpreters`. "x.*" stands for x and its submodules. Any
# other module path (`flax.nnx.graphlib`, `flax.nnx.nn.attention`, `flax.linen.module`) is
# an internal, even where its names are not private.
PUBLIC_MODULES = (
  "flax",
  "flax.core",
  "flax.core.frozen_dict",
  "flax.core.meta",
  "flax.cursor",
  "flax.errors",
  "flax.jax_utils",
  "flax.linen",
  "flax.nnx",
  "flax.serialization",
  "flax.struct",
  "flax.training.*",
  "flax.traverse_util",
  "jax",
  "jax.core",
  "jax.debug",
  "jax.dlpack",
  "jax.distributed",
  "jax.dtypes",
  "jax.errors",
  "jax.experimental.mesh_utils",
  "jax.experimental.multihost_utils",
  "jax.export",
  "jax.ffi",
  "jax.flatten_util",
  "jax.image",
  "jax.lax.*",
  "jax.monitoring",
  "jax.nn.*",
  "jax.numpy.*",
  "jax.ops",
  "jax.profiler",
  "jax.random",
  "jax.scipy.*",
  "jax.sharding",
  "jax.stages",
  "jax.tree",
  "jax.tree_util",
  "jax.typing",
)
INTERNAL_ROOTS = ("flax", "jax")
COMPAT = "flaxlens._compat"

SOURCE = pathlib.Path(__file__).resolve().parents[2] / "flaxlens"
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
  """The unit a private name may not leave: a layer (`core`, `linen`, `nnx`, the root), or,
  inside `tools`, the module itself: the tools share what they share through the public
  names of `tools.base`, so a private name there is one module's own."""
  return module if _layer(module) == "tools" else _layer(module)


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
  """`_name`, but not `__name` nor a display protocol's `_repr_html_` (IPython's)."""
  return name.startswith("_") and not name.startswith("__") and not name.endswith("_")


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


def _public(module: str) -> bool:
  return any(
    module == m or (m.endswith(".*") and (module + ".").startswith(m[:-1])) for m in PUBLIC_MODULES
  )


@functools.cache
def _resolve(path: str) -> object:
  """The object a dotted Flax/JAX path names in the installed versions, or `_UNKNOWN`."""
  parent, _, last = path.rpartition(".")
  if not parent:
    return importlib.import_module(path)
  owner = _resolve(parent)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Deprecated names are still names.
    try:
      return getattr(owner, last)
    except AttributeError:
      pass
    if isinstance(owner, types.ModuleType):
      try:  # A submodule not imported yet.
        return importlib.import_module(path)
      except ImportError:
        pass
  return _UNKNOWN


_UNKNOWN = object()


def _internal_prefix(path: str) -> str | None:
  """The shortest prefix of a dotted Flax/JAX path that is internal, or None: a component
  starting with `_`, or a module (what the installed Flax and JAX resolve the prefix to)
  not in `PUBLIC_MODULES`, unless it is only passed through to a public one
  (`jax.experimental` to `jax.experimental.multihost_utils`). A prefix they do not resolve
  counts as internal: a name that cannot be checked is refused rather than let through."""
  parts = path.split(".")
  if parts[0] not in INTERNAL_ROOTS:
    return None
  module = parts[0]  # The module the names after it are read from.
  for end in range(2, len(parts) + 1):
    prefix = ".".join(parts[:end])
    last = parts[end - 1]
    if last.startswith("_") and not last.startswith("__"):
      return prefix
    if module is None:
      continue  # An attribute of an object that is not a module.
    value = _resolve(prefix)
    if value is _UNKNOWN:
      return prefix
    if isinstance(value, types.ModuleType):
      module = prefix
      if not _public(module) and not any(m.startswith(module + ".") for m in PUBLIC_MODULES):
        return module
    elif not _public(module):
      return module
    else:
      module = None
  return None


def _internals_of(module: str, path: pathlib.Path) -> list[str]:
  """`"module:line uses flax.x._y"` for each Flax/JAX internal the module's code names."""
  tree = ast.parse(path.read_text(), str(path))
  found: set[tuple[int, str]] = set()
  aliases: dict[str, str] = {}  # a local name bound to a Flax or JAX object
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        found.add((node.lineno, alias.name))
        if alias.asname:
          aliases[alias.asname] = alias.name
        else:
          root = alias.name.split(".")[0]
          aliases[root] = root
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      for alias in node.names:
        found.add((node.lineno, f"{node.module}.{alias.name}"))
        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute):
      chain = [node.attr]
      value = node.value
      while isinstance(value, ast.Attribute):
        chain.append(value.attr)
        value = value.value
      if isinstance(value, ast.Name) and value.id in aliases:
        found.add((node.lineno, ".".join([aliases[value.id], *reversed(chain)])))
  uses = {(line, _internal_prefix(name)) for line, name in found}
  return [f"{module}:{line} uses {name}" for line, name in sorted(u for u in uses if u[1])]


def flax_internals_used(source: pathlib.Path) -> dict[str, list[str]]:
  """Each module of the package at `source`, with the Flax/JAX internals it names."""
  return {module: _internals_of(module, path) for module, path in _module_names(source).items()}


def _in_compat(module: str) -> bool:
  return module == COMPAT or module.startswith(COMPAT + ".")


def internals_outside_compat(
  internals: dict[str, list[str]], imports: dict[str, list[Import]]
) -> list[str]:
  """Internals named outside `_compat`, and `Internal`s made there from `_compat`'s class."""
  found = [use for module, uses in internals.items() if not _in_compat(module) for use in uses]
  found += [
    str(i)
    for i in _all(imports)
    if not _in_compat(i.importer) and i.module == COMPAT and i.name == "Internal"
  ]
  return found


def internals_imported_in_compat(internals: dict[str, list[str]]) -> list[str]:
  return [use for module, uses in internals.items() if _in_compat(module) for use in uses]


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


def test_inside_tools_a_private_name_stays_in_its_module(tmp_path):
  """Two modules of one `tools` job share public names only; the job's own `__init__`
  taking a private module is no crossing."""
  source = _write(
    tmp_path,
    {
      "__init__.py": "",
      "tools/__init__.py": "",
      "tools/job/__init__.py": "from flaxlens.tools.job import _a\n",
      "tools/job/_a.py": "_helper = 1\nshared = 2\n",
      "tools/job/_b.py": "from flaxlens.tools.job._a import _helper, shared\n",
    },
  )
  assert list(map(str, private_names_across_packages(read_imports(source)))) == [
    "flaxlens.tools.job._b:1 imports flaxlens.tools.job._a._helper"
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


def test_no_private_attribute_is_read_across_core_linen_nnx_root_and_tools_jobs():
  found = private_attributes_across_packages(SOURCE)
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


def test_the_internals_rule_finds_each_form_of_internal_use(tmp_path):
  """Imports of `_` paths, non-public modules (passing through to a public one is not a
  use) and `_` names, attribute paths, names the installed Flax lacks, `Internal`s."""
  source = _write(
    tmp_path,
    {
      "__init__.py": "",
      "_compat/__init__.py": "class Internal:\n  pass\n",
      "_compat/nnx_graph.py": (
        "from flax.nnx import graphlib\nfrom flaxlens._compat import Internal\n"
      ),
      "core/__init__.py": "",
      "core/_a.py": (
        "import jax\nfrom jax._src import core\nfrom flax.linen import module as m\n"
        "def f():\n  from flax.core.lift import _partial_pack\n  return jax._src.core\n"
      ),
      "nnx/__init__.py": "",
      "nnx/_b.py": (
        "import flax.linen as nn\nfrom flax import nnx\n"
        "from flaxlens._compat import Internal\n"
        "x = nnx.graph.flatten, nn._private, nnx.Module, jax.core.Tracer, nn.__name__\n"
      ),
      "tools/__init__.py": "",
      "tools/_c.py": (
        "import jax\nimport flax.linen.attention\n"
        "from flax.nnx.nn import attention as nnx_attention\n"
        "from jax.experimental import multihost_utils\nfrom flax import nnx\n"
        "x = nnx_attention.dot_product_attention_weights, multihost_utils.process_allgather\n"
        "y = jax.experimental.pjit, nnx.no_such_name, nnx.Module.no_such_name\n"
      ),
    },
  )
  internals = flax_internals_used(source)
  assert internals_outside_compat(internals, read_imports(source)) == [
    "flaxlens.core._a:2 uses jax._src",
    "flaxlens.core._a:3 uses flax.linen.module",
    "flaxlens.core._a:5 uses flax.core.lift",
    "flaxlens.core._a:6 uses jax._src",
    "flaxlens.nnx._b:4 uses flax.linen._private",
    "flaxlens.nnx._b:4 uses flax.nnx.graph",
    "flaxlens.tools._c:2 uses flax.linen.attention",
    "flaxlens.tools._c:3 uses flax.nnx.nn",
    "flaxlens.tools._c:6 uses flax.nnx.nn",
    "flaxlens.tools._c:7 uses flax.nnx.no_such_name",
    "flaxlens.tools._c:7 uses jax.experimental.pjit",
    "flaxlens.nnx._b:3 imports flaxlens._compat.Internal",
  ]
  assert internals_imported_in_compat(internals) == [
    "flaxlens._compat.nnx_graph:1 uses flax.nnx.graphlib"
  ]


def test_no_flax_or_jax_internal_is_used_outside_compat(imports):
  found = internals_outside_compat(flax_internals_used(SOURCE), imports)
  assert not found, "Flax/JAX internals outside flaxlens/_compat:\n" + "\n".join(found)


def test_compat_names_internals_as_data_never_imports_them():
  found = internals_imported_in_compat(flax_internals_used(SOURCE))
  assert not found, "imports of internals in flaxlens/_compat (use Internal):\n" + "\n".join(found)


# Rooms one can hold in one's head: a module of at most this many lines, a function body
# (its docstring aside) of at most this many, unless the docstring's first paragraph ends
# with a sentence starting "Long because" that says why.
MODULE_LINES = 800
FUNCTION_LINES = 80


def rooms_too_big(source: pathlib.Path) -> list[str]:
  """The modules and functions under `source` beyond the sizes above, as `path: size`."""
  found = []
  for path in sorted(source.rglob("*.py")):
    text = path.read_text()
    name = path.relative_to(source.parent)
    lines = text.count("\n")
    if lines > MODULE_LINES:
      found.append(f"{name}: {lines} lines")
    for node in ast.walk(ast.parse(text)):
      if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        continue
      docstring = ast.get_docstring(node) or ""
      body = node.body[1:] if docstring else node.body
      if not body:
        continue
      length = body[-1].end_lineno - body[0].lineno + 1
      if length > FUNCTION_LINES and "Long because" not in docstring:
        found.append(f"{name}:{node.lineno} {node.name}: a body of {length} lines")
  return found


def test_rooms_too_big_finds_a_long_module_and_a_long_function_unless_it_says_why(tmp_path):
  long_body = "".join(f"  x{n} = {n}\n" for n in range(FUNCTION_LINES + 1))
  source = _write(
    tmp_path,
    {
      "__init__.py": "",
      "a.py": f"def f():\n{long_body}\n\ndef g():\n  '''Long because: a table.'''\n{long_body}",
      "b.py": "\n" * (MODULE_LINES + 1),
    },
  )
  assert rooms_too_big(source) == [
    f"flaxlens/a.py:1 f: a body of {FUNCTION_LINES + 1} lines",
    f"flaxlens/b.py: {MODULE_LINES + 1} lines",
  ]


def test_every_module_and_function_fits_in_ones_head():
  found = rooms_too_big(SOURCE)
  assert not found, "too big to hold in one's head:\n" + "\n".join(found)


# `tools.base` is the bottom of `tools`: it imports no other job, and the jobs other than
# `analysis` (and the families to come) stand on it, not on `analysis`.
STANDS_ON_BASE = ("base", "export", "files", "harvest", "isolation", "view")


def tools_above_base(imports: dict[str, list[Import]]) -> list[Import]:
  """Imports by `tools.base` of another job, and by the jobs of `STANDS_ON_BASE` of
  `tools.analysis`."""
  found = []
  for i in _all(imports):
    parts, taken = i.importer.split("."), i.module.split(".")
    if len(parts) < 3 or parts[1] != "tools" or len(taken) < 3 or taken[1] != "tools":
      continue
    job, other = parts[2], taken[2]
    if (job == "base" and other != "base") or (job in STANDS_ON_BASE and other == "analysis"):
      found.append(i)
  return found


def test_tools_base_is_the_bottom_and_the_other_jobs_do_not_stand_on_analysis(imports):
  found = tools_above_base(imports)
  assert not found, "imports above tools.base:\n" + "\n".join(map(str, found))


def test_the_base_rule_finds_base_importing_a_job_and_a_job_importing_analysis(tmp_path):
  source = _write(
    tmp_path,
    {
      "__init__.py": "",
      "tools/__init__.py": "",
      "tools/base/__init__.py": "",
      "tools/base/_a.py": "from flaxlens.tools.view import _v\n",
      "tools/view/__init__.py": "",
      "tools/view/_v.py": "x = 1\n",
      "tools/harvest/__init__.py": "",
      "tools/harvest/_h.py": "from flaxlens.tools.analysis._s import sweep\n",
      "tools/analysis/__init__.py": "",
      "tools/analysis/_s.py": "from flaxlens.tools.base._a import x\nsweep = 1\n",
    },
  )
  assert list(map(str, tools_above_base(read_imports(source)))) == [
    "flaxlens.tools.base._a:1 imports flaxlens.tools.view._v",
    "flaxlens.tools.harvest._h:1 imports flaxlens.tools.analysis._s.sweep",
  ]
