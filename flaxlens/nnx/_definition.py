"""The static definition of a converted NNX module, and rebuilding the module from it.

A node keeps its module's `GraphDef` and variable shapes (`NNXModuleDef`); a run merges
it with the tree's current values into a private copy (`rebuild`). What a run needs to
find in the copy (its modules, its variables by path) is worked out once per definition
(`_Layout`) and looked up in the objects the merge made (`PrivateCopy`), instead of
walking the copy's graph at every call. Static attributes changed on a subtree alone
(`node.eval()` grafted back into a tree) are found by `static_edits` and set on the
rebuilt copy. Flax internals used:
through `flaxlens._compat` (`nnx_graph`, `nnx_variables`, `tracing`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict

from flaxlens._compat import nnx_graph, nnx_variables, tracing
from flaxlens._compat.nnx_graph import leaf_paths
from flaxlens.core._cache import Derived
from flaxlens.core._names import Path
from flaxlens.core._node import CallNode
from flaxlens.core._runtime import private_value
from flaxlens.core._walk import calls_fixed, own_call_nodes


def abstract(value: Any) -> Any:
  """`value` with every array replaced by its `jax.ShapeDtypeStruct`."""
  return jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, value
  )


class NNXModuleDef:
  """The static definition of a converted module: its `GraphDef` and variable shapes.

  Attributes:
    graphdef: the module's `nnx.GraphDef` (static attributes such as `deterministic`
      included, and the type and metadata of every variable).
    abstract_leaves: shape and dtype (`jax.ShapeDtypeStruct`s) of every variable of
      `graphdef`, in the order `nnx.merge` takes them.
    leaf_paths: the paths of those variables, in the same order.

  Its hash is computed once, when first asked for (not at conversion): hashing a
  `GraphDef` walks all of it, and jit looks up its cache by the static fields of a tree
  on every call. A static attribute NNX cannot hash
  (a dict, a list) leaves the variables' paths as the hash; equality still compares
  the whole `GraphDef`, as NNX does.

  The definitions of a converted model's submodules are `derived` from the root's:
  their `GraphDef` is worked out when first needed (running, isolating or exporting
  that call on its own), from a template of the root merged with the abstract leaves.
  Two derived definitions are equal when they name the same path of equal roots.
  """

  __slots__ = (
    "_graphdef",
    "_abstract_leaves",
    "_leaf_paths",
    "family",
    "_hash",
    "_statics",
    "_layout",
    "_source",
    "_template",
  )

  def __init__(
    self,
    graphdef: Any,
    abstract_leaves: tuple[Any, ...],
    paths: tuple[Path, ...] | None = None,
    family: object | None = None,
  ):
    self._graphdef = graphdef
    self._abstract_leaves = abstract_leaves
    self._leaf_paths = leaf_paths(graphdef) if paths is None else paths
    # Definitions made together from one model (by conversion, or by one change of
    # static attributes) share a family: they agree on every module they both hold.
    self.family = object() if family is None else family
    self._statics: dict[Path, dict[str, Any]] | None = None
    self._layout: _Layout | None = None
    self._source: tuple[NNXModuleDef, Path] | None = None
    self._template: Any = None
    self._hash: int | None = None

  @classmethod
  def derived(cls, source: NNXModuleDef, path: Path) -> NNXModuleDef:
    """The definition of the module at `path` (relative) inside `source`'s module."""
    self = object.__new__(cls)
    self._graphdef = self._abstract_leaves = self._leaf_paths = None
    self.family = source.family
    self._statics = None
    self._layout = None
    self._source = (source, path)
    self._template = None
    self._hash = None
    return self

  @property
  def graphdef(self) -> Any:
    if self._graphdef is None:
      self._resolve()
    return self._graphdef

  @property
  def abstract_leaves(self) -> tuple[Any, ...]:
    if self._abstract_leaves is None:
      self._resolve()
    return self._abstract_leaves

  @property
  def leaf_paths(self) -> tuple[Path, ...]:
    if self._leaf_paths is None:
      self._resolve()
    return self._leaf_paths

  def _resolve(self) -> None:
    assert self._source is not None
    source, path = self._source
    graphdef, variables = nnx_graph.flatten(navigate(source.template(), path))
    self._abstract_leaves = tuple(abstract(nnx_variables.raw_value(v)) for _, v in variables)
    self._leaf_paths = tuple(p for p, _ in variables)
    self._graphdef = graphdef

  def template(self) -> Any:
    """The module merged from the definition with its abstract leaves (made once)."""
    if self._template is None:
      self._template = nnx.merge(self.graphdef, list(self.abstract_leaves))
    return self._template

  def __hash__(self) -> int:
    if self._hash is None:
      if self._source is not None:
        self._hash = hash(("derived", hash(self._source[0]), self._source[1]))
      else:
        found = _hash_or(self._graphdef, lambda: hash(self._leaf_paths))
        self._hash = _hash_or((found, self._abstract_leaves), lambda: found)
    return self._hash

  def __eq__(self, other: object) -> bool:
    if self is other:
      return True
    if type(other) is not NNXModuleDef or hash(self) != hash(other):
      return False
    if self._source is not None or other._source is not None:
      mine, theirs = self._source, other._source
      return (
        mine is not None and theirs is not None and mine[1] == theirs[1] and mine[0] == theirs[0]
      )
    return equal(self.graphdef, other.graphdef) and equal(
      self.abstract_leaves, other.abstract_leaves
    )

  def __repr__(self) -> str:
    return f"NNXModuleDef(<GraphDef>, {len(self.leaf_paths)} variables)"

  def with_graphdef(self, graphdef: Any, family: object) -> NNXModuleDef:
    """The same module with other static attributes (same variables)."""
    return NNXModuleDef(graphdef, self.abstract_leaves, self.leaf_paths, family)

  def statics(self) -> dict[Path, dict[str, Any]]:
    """The static attributes of each module of the definition, by relative path."""
    if self._statics is None:
      template = nnx.merge(self.graphdef, [None] * len(self.leaf_paths))
      self._statics = {
        tuple(p): nnx_graph.static_attributes(m) for p, m in nnx_graph.iter_modules(template)
      }
    return self._statics

  def rebuild(self, values: dict[Path, Any], created: dict[Path, Any]) -> PrivateCopy:
    """The module rebuilt from `values`, with its modules and variables at hand.

    `nnx.merge` creates fresh `Variable`s of the types and metadata the `GraphDef`
    records, and values that can change in place (NumPy arrays) are copied, so nothing
    is shared with the model the values came from but immutable arrays. Variables no
    node holds belong to calls that were replaced: they stand in as zeros of their
    shape, so that transforms over the module's state (`nnx.vmap`, `nnx.scan`) still
    see the shapes they need; their paths are the copy's `orphans`. `created`
    variables (made by the converted call) are set as attributes of their modules.
    """
    leaves = [
      private_value(values[p]) if p in values else jax.tree_util.tree_map(_zeros, a)
      for p, a in zip(self.leaf_paths, self.abstract_leaves, strict=True)
    ]
    model, made = nnx_graph.merge_indexed(self.graphdef, leaves)
    layout = self.layout(model, made)
    for path, variable in created.items():
      setattr(navigate(model, path[:-1]), path[-1], variable)
    orphans = {p for p in self.leaf_paths if p not in values}
    copy = PrivateCopy(model, made, layout, created, orphans)
    # A copy can serve later calls when every variable is one the merge made (none
    # created, none orphaned) and it was made outside any JAX trace (see `refill`).
    copy.reusable = (
      layout.checkable
      and not created
      and not orphans
      and len(copy.variables) == len(self.leaf_paths)
      and tracing.at_top_level()
    )
    return copy

  def layout(self, model: Any, made: Mapping[int, Any]) -> _Layout:
    """Where the modules and variables of a copy merged from the definition sit (worked
    out once, from the `GraphDef`; `model` and `made` are that merge's, taken before a
    call changes the copy)."""
    if self._layout is None:
      self._layout = _Layout.of(self.graphdef, model, made)
    return self._layout

  def private_copy(self, model: Any, made: Mapping[int, Any]) -> PrivateCopy:
    """A `PrivateCopy` of `model`, just merged from the definition (`made`: the objects
    the merge made), holding every variable of the definition."""
    return PrivateCopy(model, made, self.layout(model, made), {}, set())


class _Layout:
  """Where a definition's modules and variables sit in a copy, by `GraphDef` index.

  Read from the definition's `GraphDef` (`nnx_graph.graph_nodes`), in `nnx.split`'s
  order, so that no copy is walked: `modules`, every module once (at its first path),
  `variables` as `nnx.state` finds them (each once, at its first path), and `nodes`,
  every graph node whose attributes a run could change. `checkable` is False when the
  copy holds a graph container that can change without an attribute of an NNX object
  the merge made changing (a list or dict attribute, a custom graph node type or
  pytree); such copies are always walked after the run. A tree-mode `GraphDef` (no
  indices) is laid out by walking its first copy instead (`walked`), and never
  checkable.
  """

  __slots__ = ("modules", "variables", "nodes", "checkable", "indexed")

  def __init__(
    self,
    modules: tuple[tuple[int | None, Path], ...],
    variables: tuple[tuple[int | None, Path], ...],
    nodes: tuple[int, ...],
    checkable: bool,
    indexed: bool,
  ):
    self.modules = modules
    self.variables = variables
    self.nodes = nodes
    self.checkable = checkable
    self.indexed = indexed

  @classmethod
  def of(cls, graphdef: Any, model: Any, made: Mapping[int, Any]) -> _Layout:
    """The layout of `graphdef`, whose merge made `model` (`made`: by index)."""
    found = nnx_graph.graph_nodes(graphdef)
    if found is None:
      return cls.walked(model, made)
    modules, variables, nodes, checkable = [], [], [], True
    for path, kind, index in found:
      if issubclass(kind, nnx.Variable):
        variables.append((index, path))
        continue
      if issubclass(kind, nnx.Pytree) and index is not None:
        nodes.append(index)
        if issubclass(kind, nnx.Module):
          modules.append((index, path))
        continue
      checkable = checkable and _fixed_container(path, kind)
    return cls(tuple(modules), tuple(variables), tuple(nodes), checkable, True)

  @classmethod
  def walked(cls, model: Any, made: Mapping[int, Any]) -> _Layout:
    """The layout found by walking `model` (`nnx.iter_modules`, `nnx.state`)."""
    index = {id(obj): i for i, obj in made.items()}
    return cls(
      tuple((index.get(id(m)), tuple(p)) for p, m in nnx_graph.iter_modules(model)),
      tuple((index.get(id(v)), tuple(p)) for p, v in nnx.to_flat_state(nnx.state(model))),
      tuple(i for i, obj in made.items() if isinstance(obj, nnx.Pytree)),
      all(_fixed_unless_set(path, value, index) for path, value in nnx.iter_graph(model)),
      False,
    )

  def modules_of(self, model: Any, made: Mapping[int, Any]) -> tuple[tuple[Path, Any], ...]:
    """`(path, module)` of every module of a copy just merged (`made`: by index)."""
    if self.indexed:
      return tuple((p, made[i]) for i, p in self.modules)
    return tuple((tuple(p), m) for p, m in nnx_graph.iter_modules(model))


def _fixed_container(path: Path, kind: type) -> bool:
  """Whether a container of type `kind` that a `GraphDef` holds at `path` changes only
  when an attribute of the NNX object holding it is set: True for tuples, `FrozenDict`,
  None and NNX's own `_pytree__` bookkeeping; False for lists, dicts, other pytrees and
  graph node types (which a call could change in place) and bare array refs."""
  if issubclass(kind, tuple | FrozenDict | type(None)):
    return True
  return bool(path) and nnx_graph.is_bookkeeping(path[-1])


def _fixed_unless_set(path: Path, value: Any, made: Mapping[int, int]) -> bool:
  """Whether `value`, found at `path` in a copy, changes only by setting an attribute.

  True for the NNX objects and variables the merge made (`made`: their ids; a run
  compares their attributes), immutable containers, NNX's own `_pytree__` bookkeeping
  and values NNX does not traverse; False for a list, a dict or a custom graph node
  type, which a call could change in place.
  """
  if isinstance(value, nnx.Pytree | nnx.Variable):
    return id(value) in made
  if isinstance(value, tuple | FrozenDict) or value is None:
    return True
  if path and nnx_graph.is_bookkeeping(path[-1]):
    return True
  return not nnx_graph.is_graph_container(value)


class PrivateCopy:
  """A module rebuilt for a run, and how to read its variables back after the run.

  Attributes:
    model: the rebuilt module.
    modules: `(path, module)` of every module the merge made, each once (at its first
      path in `nnx.split`'s order).
    orphans: the paths of the variables no node holds (see `NNXModuleDef.rebuild`).
    variables: `(path, variable)` of the variables the merge made (and those the
      call created), when the copy is checkable; else empty.
    reusable: whether the copy may serve another eager call of the same root node
      (set by `NNXModuleDef.rebuild`; see `refill` and `intact`).
  """

  __slots__ = (
    "model",
    "modules",
    "orphans",
    "variables",
    "reusable",
    "_checkable",
    "_nodes",
    "_attributes",
    "_metadata",
    "_intact",
    "_sites",
    "_classes",
  )

  def __init__(
    self,
    model: Any,
    made: Mapping[int, Any],
    layout: _Layout,
    created: dict[Path, Any],
    orphans: set[Path],
  ):
    self.model = model
    self.orphans = orphans
    self.reusable = False
    self._checkable = layout.checkable
    self.modules = layout.modules_of(model, made)
    if layout.checkable:
      self.variables: tuple[tuple[Path, Any], ...] = tuple(
        (p, made[i]) for i, p in layout.variables
      ) + tuple(created.items())
      self._nodes = [made[i] for i in layout.nodes]
    else:
      self.variables = ()
      self._nodes = []
    self._attributes: list[tuple[Any, tuple[str, ...], tuple[Any, ...]]] | None = None
    self._metadata: tuple[dict[str, Any], ...] | None = None
    self._intact = False
    self._sites: tuple[Path, tuple[tuple[Path, Any], ...]] | None = None
    self._classes = frozenset(type(m) for _, m in self.modules)

  def sites(self, prefix: Path) -> tuple[tuple[Path, Any], ...]:
    """`(path from the tree's root, module)` of every module, for `NNXInterceptor.mark`."""
    if self._sites is None or self._sites[0] != prefix:
      self._sites = (prefix, tuple((prefix + tuple(p), m) for p, m in self.modules))
    return self._sites[1]

  @property
  def classes(self) -> frozenset[type]:
    """The classes of the copy's modules."""
    return self._classes

  def seal(self) -> None:
    """Notes the attributes of every graph node of the copy, before the run changes any."""
    self._attributes = [
      (node, tuple(vars(node)), tuple(vars(node).values())) for node in self._nodes
    ]
    if self.reusable and self._metadata is None:
      self._metadata = tuple(dict(nnx_variables.metadata(v)) for _, v in self.variables)

  def state(self) -> dict[Path, Any]:
    """`{path: raw value}` of the copy's variables now, orphans left out.

    Read from the variables the merge made while every graph node holds the very
    attributes it held at `seal()` (so no variable was added, removed, replaced or
    moved); otherwise, and for a copy that is not checkable, by walking the copy with
    `nnx.state`.
    """
    pairs = ((p, nnx_variables.raw_value(v)) for p, v in self.current_variables())
    return {p: v for p, v in pairs if p not in self.orphans}

  def current_variables(self) -> tuple[tuple[Path, Any], ...]:
    """`(path, variable)` of every variable the copy holds now, as `nnx.state` finds them.

    The variables the merge made (and those created for the run) while every graph
    node holds the very attributes it held at `seal()`; otherwise, and for a copy that
    is not checkable, found by walking the copy with `nnx.state`.
    """
    self._intact = self._checkable and self._attributes is not None and self._unchanged()
    if self._intact:
      return self.variables
    return tuple((tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(self.model)))

  def intact(self) -> bool:
    """Whether a reusable copy is, after its run, as its merge made it but for values.

    Every graph node holds the attributes it held at `seal()` (checked by `state()`)
    and every variable its metadata (same keys, the very same values).
    """
    if not (self.reusable and self._intact and self._metadata is not None):
      return False
    return not any(
      metadata_changed(before, variable)
      for (_, variable), before in zip(self.variables, self._metadata, strict=True)
    )

  def refill(self, values: Mapping[Path, Any]) -> None:
    """Gives an intact, emptied copy the values of another call (see `NNXAdapter`)."""
    for path, variable in self.variables:
      nnx_variables.set_raw_value(variable, private_value(values[path]))

  def empty(self) -> None:
    """Drops the copy's references to the run: its arrays, and the sites of its modules
    (whose token holds the run's side inputs), so a kept copy holds no memory."""
    for _, variable in self.variables:
      nnx_variables.set_raw_value(variable, None)
    for _, module in self.modules:
      nnx_graph.set_site(module, None)
    self._attributes = None

  def _unchanged(self) -> bool:
    for node, names, values in self._attributes or ():
      now = vars(node)
      if tuple(now) != names or not all(map(operator.is_, values, now.values())):
        return False
    return True


def metadata_changed(before: Mapping[str, Any], variable: Any) -> bool:
  """Whether `variable`'s metadata differs from `before` (a copy of it, made earlier).

  Values are compared as `dict ==` does (the same object first, then `==`); a
  comparison that raises (arrays held as metadata) counts as a change.
  """
  try:
    return bool(nnx_variables.metadata(variable) != before)
  except Exception:
    return True


def _hash_or(value: Any, fallback: Callable[[], int]) -> int:
  try:
    return hash(value)
  except TypeError:
    return fallback()


def equal(a: Any, b: Any) -> bool:
  """`a == b`, False where comparing raises (arrays held as static attributes, say)."""
  if a is b:
    return True
  try:
    return bool(a == b)
  except Exception:
    return False


def static_edits(root: CallNode) -> dict[Path, dict[str, Any]]:
  """Static attributes that nodes under `root` set otherwise than `root.definition`.

  A subtree whose mode was changed on its own (`node.eval()` grafted back into the
  tree) holds definitions of another family than the root's; where they differ from
  the root's, their modules' static attributes are set on the rebuilt model (nodes
  deeper in the tree win). Kept on a root node whose calls cannot change.
  """
  return _STATIC_EDITS(root)


def _static_edits(root: CallNode) -> dict[Path, dict[str, Any]]:
  family = root.definition.family
  edits: dict[Path, dict[str, Any]] = {}
  base: dict[Path, dict[str, Any]] | None = None
  for node in own_call_nodes(root):
    if node.definition.family is family:
      continue
    base = root.definition.statics() if base is None else base
    rel = node.path[len(root.path) :]
    for sub, statics in node.definition.statics().items():
      before = base.get(rel + sub)
      if before is None:
        continue
      changed = {k: v for k, v in statics.items() if k not in before or not equal(before[k], v)}
      if changed:
        edits.setdefault(rel + sub, {}).update(changed)
  return edits


_STATIC_EDITS = Derived("static_edits", _static_edits, lambda root, _: calls_fixed(root))


def apply_static_edits(model: Any, edits: dict[Path, dict[str, Any]]) -> None:
  """Sets the static attributes `static_edits` found on the modules of `model`."""
  for path, attributes in edits.items():
    module = navigate(model, path)
    for name, value in attributes.items():
      nnx_graph.set_static(module, name, value)


def _zeros(leaf: Any) -> Any:
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jnp.zeros(leaf.shape, leaf.dtype)
  return leaf


def navigate(root: Any, path: Path) -> Any:
  """The object at `path` (attribute names and list indices) inside an NNX graph."""
  node = root
  for key in path:
    node = node[key] if isinstance(key, int) else getattr(node, key)
  return node


def private_container(value: Any) -> Any:
  """`value` with every plain list, dict and set in it copied (recursively, through
  tuples too); other objects are kept. `value` itself when it holds none.

  A static attribute NNX keeps in a `GraphDef` is the very object of the module it was
  split from; copying its plain containers keeps a call that changes them in place
  (`self.log.append(...)`) from changing the module the definition came from.
  """
  kind = type(value)
  if kind is list or kind is tuple:
    items = [private_container(v) for v in value]
    if kind is tuple and all(map(operator.is_, items, value)):
      return value
    return kind(items)
  if kind is dict:
    return {k: private_container(v) for k, v in value.items()}
  if kind is set:
    return set(value)
  return value


def own_containers(model: Any) -> bool:
  """Gives every NNX object of `model` its own copies of the plain containers its static
  attributes hold (`private_container`); whether any was copied."""
  copied = False
  for _, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Pytree):
      continue
    for name, value in nnx_graph.static_attributes(node).items():
      private = private_container(value)
      if private is not value:
        nnx_graph.set_static(node, name, private)
        copied = True
  return copied


def plain_module(graphdef: Any, leaves: list[Any]) -> Any:
  """A plain NNX module (no run site) from a split of a module of a run."""
  module = nnx.merge(graphdef, leaves)
  for _, sub in nnx_graph.iter_modules(module):
    nnx_graph.clear_site(sub)
  return module


def split_leaves(module: Any) -> tuple[Any, list[Any]]:
  """`(graphdef, leaves)` of `module`, leaves in the order `nnx.merge` takes them."""
  graphdef, state = nnx.split(module)
  flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
  return graphdef, [nnx_variables.raw_value(flat[p]) for p in leaf_paths(graphdef)]
