"""NNX's graph as flaxlens reads it: flatten and merge orders, static attributes, sites.

Checked with flax 0.12.0–0.12.8 (`flax.nnx.graphlib` was `flax.nnx.graph` up to 0.12.4;
tree-mode `GraphDef`s, `TreeNodeDef`, came in 0.12.5). NNX has no interception hook
(flax issue 4666), so flaxlens marks the modules of a private copy with a site
attribute. Instance attributes that are not data ride in the `GraphDef` as static
values, so a module re-created inside `nnx.scan`, `nnx.vmap`, `nnx.remat` or `nnx.jit`
still knows its path and run; the attribute's name starts with `_pytree__`, NNX's own
bookkeeping prefix, which NNX's reprs skip and `nnx.bridge.ToNNX` does not take for a
Linen collection.

What else is read here: the leaf order of `flax.nnx.graphlib.flatten` (what `nnx.split`
runs first, the order `GraphDef.num_leaves` counts and a list of leaves is merged in);
the layout of a graph-mode `GraphDef` (`nodes` and `attributes` in the order
`flax.nnx.graphlib.unflatten` reads them: a `NodeDef` takes its next `num_attributes`
attributes, an attribute marked `NodeAttr` the next node, a `NodeRef` names a node seen
before), read by `graph_nodes` so that a merged copy's modules and variables are found
without walking the copy;
the `flax.nnx.graphlib.IndexMap` that `flax.nnx.graphlib.unflatten(index_ref=...)`
fills while merging; a pytree module's `_pytree__nodes` and `_pytree__is_pytree` (which
attributes are data), `flax.nnx.graphlib.get_node_impl` and `is_node` (what NNX
traverses); `nnx.merge` taking any objects as leaves; the base classes whose methods
are NNX's own (`flax.nnx.reprlib`); and, for the artifact load policy, the classes a
`GraphDef` is made of (`flax.nnx.graphlib.NodeDef`, `NodeRef` for a shared node, ...),
`GenericPytree`, `flax.nnx.pytreelib.PytreeState` and `flax.typing.HashableMapping`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

from flax import nnx

from flaxlens._compat import Formerly, Internal, nnx_variables, unsupported


def _graphlib(name: str, *, added_in: str = "") -> Internal:
  """`name` of `flax.nnx.graphlib`, which flax 0.12.0–0.12.4 called `flax.nnx.graph`."""
  older = Formerly("flax.nnx.graph", name, "flax 0.12.0–0.12.4")
  return Internal("flax.nnx.graphlib", name, formerly=(older,), added_in=added_in)


FLATTEN = _graphlib("flatten")
UNFLATTEN = _graphlib("unflatten")
INDEX_MAP = _graphlib("IndexMap")
GET_NODE_IMPL = _graphlib("get_node_impl")
IS_NODE = _graphlib("is_node")
REPRESENTABLE = Internal("flax.nnx.reprlib", "Representable")
SEQUENCE_REPR_MIXIN = Internal("flax.nnx.reprlib", "SequenceReprMixin")
MAPPING_REPR_MIXIN = Internal("flax.nnx.reprlib", "MappingReprMixin")
GRAPH_DATA = tuple(
  _graphlib(name)
  for name in ("GraphDef", "NodeDef", "NodeRef", "VariableDef", "NodeAttr", "Static", "ArrayRefDef")
)
NODE_REF = _graphlib("NodeRef")
VARIABLE_DEF = _graphlib("VariableDef")
ARRAY_REF_DEF = _graphlib("ArrayRefDef")
TREE_NODE_DEF = _graphlib("TreeNodeDef", added_in="flax 0.12.5")
DATA_ELEM = _graphlib("DataElem", added_in="flax 0.12.5")
NODE_ATTR = _graphlib("NodeAttr")
STATIC = _graphlib("Static")
GENERIC_PYTREE = _graphlib("GenericPytree")
PYTREE_STATE = Internal("flax.nnx.pytreelib", "PytreeState")
HASHABLE_MAPPING = Internal(
  "flax.typing",
  "HashableMapping",
  formerly=(Formerly("flax.nnx.graph", "HashableMapping", "flax 0.12.0–0.12.2"),),
)

BOOKKEEPING_PREFIX = "_pytree__"
SITE_ATTRIBUTE = BOOKKEEPING_PREFIX + "flaxlens_site"


@functools.cache
def flax_bases() -> tuple[type, ...]:
  """Classes whose methods are NNX's own machinery (or container API), not layer calls."""
  return (
    nnx.Module,
    nnx.Pytree,
    nnx.Object,
    nnx.List,
    nnx.Dict,
    REPRESENTABLE(),
    SEQUENCE_REPR_MIXIN(),
    MAPPING_REPR_MIXIN(),
  )


def set_site(module: Any, site: Any) -> None:
  """Stores `site` on `module` as a static attribute (it bypasses `Pytree.__setattr__`)."""
  object.__setattr__(module, SITE_ATTRIBUTE, site)


def clear_site(module: Any) -> None:
  """Removes the site stored by `set_site`, if any."""
  vars(module).pop(SITE_ATTRIBUTE, None)


def site(module: Any) -> Any:
  """The site stored by `set_site`, or None."""
  return vars(module).get(SITE_ATTRIBUTE)


def is_bookkeeping(name: Any) -> bool:
  """Whether an attribute name is NNX's own bookkeeping (or flaxlens's site), not data."""
  return isinstance(name, str) and name.startswith(BOOKKEEPING_PREFIX)


def iter_modules(node: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
  """`(path, module)` for each NNX module in `node`'s graph, `node` included, as `nnx.iter_modules`.

  Public API: `nnx.iter_graph` filtered, which every release has (flax 0.12.0 has no
  `nnx.iter_modules` function, only the method, which later releases deprecate).

  Example:
    >>> from flax import nnx
    >>> from flaxlens._compat import nnx_graph
    >>> class Block(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.linear = nnx.Linear(2, 3, rngs=rngs)
    >>> found = nnx_graph.iter_modules(Block(nnx.Rngs(0)))
    >>> [(path, type(module).__name__) for path, module in found]
    [(('linear',), 'Linear'), ((), 'Block')]
  """
  for path, value in nnx.iter_graph(node):
    if isinstance(value, nnx.Module):
      yield path, value


def flatten(module: Any) -> tuple[Any, list[tuple[tuple[Any, ...], Any]]]:
  """`nnx.split(module)`'s `GraphDef` and `(path, variable)` pairs, in the order that
  `nnx.merge(graphdef, leaves)` takes a list of leaves.
  """
  graphdef, flat = FLATTEN()(module)
  return graphdef, [(tuple(path), variable) for path, variable in flat]


def static_attributes(module: Any, attributes: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The module's own static attributes, as its `GraphDef` records them.

  From flax 0.12.5, a pytree module (the default) keeps which attributes are data in
  `_pytree__nodes`, set when they are assigned (`nnx.data(...)` marks a dict of variables
  as data, as `nnx.bridge.ToNNX` does for Linen collections); other modules' attributes
  are data when `graphlib` flattens them as nodes or leaves. NNX's `_pytree__` bookkeeping
  is left out. `attributes`: a copy of `vars(module)` taken earlier, to read the static
  attributes the module had then (by default, those it has now).
  """
  if attributes is None:
    attributes = vars(module)
  try:
    # Before flax 0.12.5 (no `DataElem`), the graph took any attribute of a type it
    # traverses (a dict, a list) as a node, whatever `_pytree__nodes` said.
    if module._pytree__is_pytree and DATA_ELEM.or_none() is not None:
      nodes = attributes.get("_pytree__nodes", None)
      nodes = module._pytree__nodes if nodes is None else nodes
    else:
      nodes = None
  except AttributeError as e:
    raise unsupported("flax.nnx.Pytree._pytree__nodes and _pytree__is_pytree") from e
  get_node_impl = GET_NODE_IMPL() if nodes is None else None
  static = {}
  for name, value in attributes.items():
    if is_bookkeeping(name):  # (flax <= 0.12.5's `nnx.List` keeps items under int names)
      continue
    if nodes is not None:
      data = nodes.get(name, False)
    else:
      data = get_node_impl(value) is not None or nnx.is_data(value)
    if not data:
      static[name] = value
  return static


def set_static(module: Any, name: str, value: Any) -> None:
  """Sets a static attribute of an NNX module, leaving its data/static record unchanged."""
  object.__setattr__(module, name, value)


def merge_indexed(graphdef: Any, leaves: list[Any]) -> tuple[Any, Mapping[int, Any]]:
  """`nnx.merge(graphdef, leaves)`, and the objects it made by their `GraphDef` index.

  `nnx.merge` of a list calls `graphlib.unflatten` with a fresh `IndexMap`, into which
  it puts every graph node (module, `nnx.Rngs`, ...) and variable it creates under the
  node's index; passing that map in keeps it. Empty for a tree-mode `GraphDef`, which
  has no indices.
  """
  made = INDEX_MAP()()
  return UNFLATTEN()(graphdef, leaves, index_ref=made), made


def graph_nodes(graphdef: Any) -> list[tuple[tuple[Any, ...], type, int | None]] | None:
  """`(path, type, index)` of every node of a graph-mode `GraphDef`, each once.

  In `nnx.split`'s order (so a node shared by several paths is at its first path, the
  one `nnx.state` names its variables by): modules and other graph nodes, containers
  (lists, tuples, dicts, other pytrees: index None) and variables (their type). A bare
  array ref comes as the `ArrayRefDef` class. `index` is where `merge_indexed`'s map
  holds the node made from it. None for a tree-mode `GraphDef` (no indices). Reads only
  the `GraphDef`, walking no object graph.
  """
  try:
    nodes, attributes = graphdef.nodes, graphdef.attributes
  except AttributeError as e:
    raise unsupported("flax.nnx.GraphDef.nodes and attributes") from e
  if not nodes:
    return []
  tree_node_def = TREE_NODE_DEF.or_none()  # None: a release without tree mode.
  if tree_node_def is not None and isinstance(nodes[0], tree_node_def):
    return None
  node_ref, variable_def, array_ref_def = NODE_REF(), VARIABLE_DEF(), ARRAY_REF_DEF()
  node_attr = NODE_ATTR()
  found: list[tuple[tuple[Any, ...], type, int | None]] = []
  node_at = iter(nodes)
  attribute_at = iter(attributes)
  # Depth first, as `unflatten` reads them: (path, attributes left) of the open nodes.
  stack: list[list[Any]] = []
  path: tuple[Any, ...] = ()
  while True:
    node = next(node_at, None)
    if node is None:
      break
    kind = type(node)
    if kind is node_ref:
      pass
    elif kind is variable_def:
      found.append((path, node.type, node.index))
    elif kind is array_ref_def:
      found.append((path, array_ref_def, node.index))
    elif kind is tree_node_def:
      raise unsupported("a tree-mode node inside a graph-mode flax.nnx.GraphDef")
    else:  # A NodeDef (Flax's own, or flaxlib's).
      found.append((path, node.type, node.index))
      stack.append([path, node.num_attributes])
    # The next node is the value of the next attribute marked NodeAttr.
    while stack:
      top = stack[-1]
      if top[1] == 0:
        stack.pop()
        continue
      top[1] -= 1
      key, value = next(attribute_at)
      if type(value) is node_attr:
        path = (*top[0], key)
        break
    else:
      break
  if next(node_at, None) is not None:
    raise unsupported("the node order of flax.nnx.GraphDef")
  return found


def references(root: Any) -> tuple[dict[tuple[int, tuple[Any, ...]], Any], dict[int, Any]]:
  """Every reference to a variable or NNX object (module, `nnx.Rngs`) in `root`'s graph.

  Returns `(refs, owners)`: `refs` maps `(id(owner), key path inside the owner)` to the
  object referenced, where the owner is the nearest NNX object holding the reference
  (through plain containers: lists, dicts, tuples, other pytrees); `owners` maps each
  owner's id to a path from `root` (for messages). Shared objects are
  walked once but every reference to them is listed, so two graphs with equal `refs`
  hold the same objects at the same places, shared the same way. NNX's `_pytree__`
  bookkeeping and static values (neither variables nor graph nodes) are left out.
  """
  get_node_impl, is_node = GET_NODE_IMPL(), IS_NODE()
  pytree = nnx.Pytree
  # What a value is depends only on its type (NNX's registries are read by type): found
  # once per type. 0: nothing to follow, 1: a reference (a variable or an NNX object), 2: a
  # container to walk through.
  kinds: dict[type, int] = dict.fromkeys((int, float, bool, str, type(None)), 0)

  def kind_of(value: Any) -> int:
    kind = type(value)
    if issubclass(kind, nnx.Variable | pytree):
      found = 1
    else:
      found = 2 if is_node(value) else 0
    kinds[kind] = found
    return found

  refs: dict[tuple[int, tuple[Any, ...]], Any] = {}
  owners: dict[int, Any] = {id(root): ()}
  pending: list[tuple[Any, tuple[Any, ...]]] = [(root, ())]
  for owner, owner_path in pending:  # grows while walked: breadth first
    stack: list[tuple[tuple[Any, ...], Any]] = [((), owner)]
    while stack:
      rel, node = stack.pop()
      if isinstance(node, pytree):  # its attributes as they are (keys as named, unsorted)
        items = vars(node).items()
      else:
        impl = get_node_impl(node)
        if impl is None:
          continue
        items = impl.node_dict(node).items()
      for key, child in items:
        kind = kinds.get(type(child))
        if kind is None:
          kind = kind_of(child)
        if not kind or (type(key) is str and key.startswith(BOOKKEEPING_PREFIX)):
          continue
        where = (*rel, key)
        if kind == 1:
          refs[(id(owner), where)] = child
          if isinstance(child, pytree) and id(child) not in owners:
            owners[id(child)] = (*owner_path, *where)
            pending.append((child, (*owner_path, *where)))
        else:
          stack.append((where, child))
  return refs, owners


def static_values(graphdef: Any) -> list[Any] | None:
  """The values of the static attributes a graph-mode `GraphDef` holds (the very objects
  of the modules it was split from), read from its attribute list without merging it;
  None where it has no such list (a tree-mode `GraphDef`)."""
  attributes = getattr(graphdef, "attributes", None)
  if attributes is None:
    return None
  static = STATIC()
  return [value.value for _, value in attributes if type(value) is static]


def is_graph_container(value: Any) -> bool:
  """Whether NNX traverses `value` as a node of the graph (module, list, dict, ...)."""
  return IS_NODE()(value)


def leaf_count(graphdef: Any) -> int:
  """How many variables `nnx.merge(graphdef, leaves)` takes (`GraphDef.num_leaves`)."""
  try:
    return graphdef.num_leaves
  except AttributeError as e:
    raise unsupported("flax.nnx.GraphDef.num_leaves") from e


class _Marker:
  __slots__ = ("index",)

  def __init__(self, index: int):
    self.index = index


def leaf_paths(graphdef: Any) -> tuple[tuple[Any, ...], ...]:
  """The variable paths of `graphdef`, in the order `nnx.merge` takes a list of leaves.

  Merged with a marker object per leaf (NNX keeps any object as a variable's value),
  then read back from the merged module's state.
  """
  count = leaf_count(graphdef)
  probe = nnx.merge(graphdef, [_Marker(i) for i in range(count)])
  paths: list[tuple[Any, ...]] = [()] * count
  for path, variable in nnx.to_flat_state(nnx.state(probe)):
    paths[nnx_variables.raw_value(variable).index] = tuple(path)
  return tuple(paths)
