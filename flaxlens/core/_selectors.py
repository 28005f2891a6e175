"""Selections: pick nodes of any pytree, then read, replace, insert or remove them.

`select(tree)` (or `struct.select()`) returns a `Selection`: the tree plus an ordered
tuple of key paths to the selected nodes. Narrowing methods (`at`, `at_instances_of`,
`at_subtrees_where`, `at_keypaths`, `at_path`, `where`) return new selections; editing
methods (`apply`, `set`, `insert_before`, ...) rebuild only the nodes along the selected
paths and return a new tree, never mutating the old one. Traversal goes through dicts,
lists, tuples, structs and any registered pytree, using JAX's own key paths. No Flax
internals here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from flaxlens.core._checks import check_type
from flaxlens.errors import ArgumentError, SelectionError

KeyPath = tuple[Any, ...]


def _children(node: Any) -> tuple[list[tuple[Any, Any]], Any] | None:
  """One level of `node`: ([(key, child), ...], rebuild from new children), or None for a
  leaf. A struct lists every child field, those its flattening leaves out included."""
  if getattr(type(node), "flaxlens_fields_level", None) is not None:
    return node.flaxlens_fields_level()
  pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
  if jax.tree_util.treedef_is_leaf(treedef):
    return None
  return [(path[0], child) for path, child in pairs], treedef.unflatten


def _child(node: Any, key: Any) -> Any:
  level = _children(node)
  if level is not None:
    for k, child in level[0]:
      if k == key:
        return child
  raise SelectionError(f"No child {key} in {type(node).__name__}.")


def _get(root: Any, path: KeyPath) -> Any:
  node = root
  for key in path:
    node = _child(node, key)
  return node


def _walk(node: Any, path: KeyPath = ()) -> Iterable[tuple[KeyPath, Any]]:
  """Yields (path, node) for `node` and all its descendants, parents first."""
  yield path, node
  level = _children(node)
  if level is not None:
    for key, child in level[0]:
      yield from _walk(child, path + (key,))


def _replace(node: Any, updates: dict[KeyPath, Any]) -> Any:
  """Returns `node` with the subtrees at the given (relative) paths replaced."""
  if () in updates:
    return updates[()]
  level = _children(node)
  if level is None:
    raise SelectionError(f"Cannot descend into leaf {type(node).__name__} at {list(updates)}.")
  pairs, rebuild = level
  grouped: dict[Any, dict[KeyPath, Any]] = {}
  for path, value in updates.items():
    grouped.setdefault(path[0], {})[path[1:]] = value
  new_children = [
    _replace(child, grouped.pop(key)) if key in grouped else child for key, child in pairs
  ]
  if grouped:
    raise SelectionError(f"No child {list(grouped)} in {type(node).__name__}.")
  return rebuild(new_children)


def _format_path(path: KeyPath) -> str:
  return jax.tree_util.keystr(path) or "<root>"


class _Marker:
  """Stands in for a leaf while an accessor function is traced through a tree."""

  __slots__ = ("path",)

  def __init__(self, path: KeyPath):
    self.path = path


def _marked_copy(node: Any, path: KeyPath, ids: dict[int, KeyPath]) -> Any:
  level = _children(node)
  if level is None:
    return _Marker(path)
  pairs, rebuild = level
  copy = rebuild([_marked_copy(child, path + (key,), ids) for key, child in pairs])
  ids[id(copy)] = path
  return copy


def _check_callable(fn: Any, method: str) -> None:
  if not callable(fn):
    raise ArgumentError(f"Selection.{method} needs a callable, got {type(fn).__name__}: {fn!r}.")


class Selection:
  """A tree together with an ordered set of selected nodes in it.

  Example:
    >>> import flaxlens as fl
    >>> tree = {"a": [1, 2], "b": 3}
    >>> fl.select(tree).at_subtrees_where(lambda x: x == 2).expect().set(20)
    {'a': [1, 20], 'b': 3}
  """

  __slots__ = ("_root", "_paths")

  def __init__(self, root: Any, paths: Sequence[KeyPath]):
    self._root = root
    self._paths = tuple(paths)

  @property
  def keypaths(self) -> tuple[KeyPath, ...]:
    """JAX key paths of the selected nodes, in tree order."""
    return self._paths

  def __repr__(self) -> str:
    shown = ", ".join(_format_path(p) for p in self._paths[:8])
    more = f", ... ({len(self._paths)} in all)" if len(self._paths) > 8 else ""
    return f"Selection([{shown}{more}] of {type(self._root).__name__})"

  def _narrow(self, find: Callable[[KeyPath, Any], Iterable[KeyPath]]) -> Selection:
    found: list[KeyPath] = []
    for path in self._paths:
      found.extend(find(path, _get(self._root, path)))
    return Selection(self._root, found)

  def _search(self, hit: Callable[[KeyPath, Any], bool], innermost: bool) -> Selection:
    def find(path: KeyPath, node: Any) -> list[KeyPath]:
      return list(_search(node, path, hit, innermost))

    return self._narrow(find)

  # --- narrowing -----------------------------------------------------------------

  def at(self, accessor: Callable[[Any], Any], multiple: bool = False) -> Selection:
    """Selects, inside each selected node, the part that `accessor` returns.

    `accessor` navigates by attribute, key and index (`lambda t: t.layers[0]`); with
    `multiple=True` it may return a tuple or list of such parts.
    """
    _check_callable(accessor, "at")

    def find(path: KeyPath, node: Any) -> list[KeyPath]:
      ids: dict[int, KeyPath] = {}
      marked = _marked_copy(node, path, ids)
      try:
        result = accessor(marked)
      except (AttributeError, TypeError) as e:
        raise SelectionError(
          f"Selection.at: the accessor failed while navigating {_format_path(path)}"
          f" ({e}). It may only use attribute, key and index access."
        ) from e
      results = list(result) if multiple else [result]
      paths = []
      for r in results:
        if isinstance(r, _Marker):
          paths.append(r.path)
        elif id(r) in ids:
          paths.append(ids[id(r)])
        else:
          raise SelectionError(
            "Selection.at: the accessor returned something that is not a node of the"
            f" tree under {_format_path(path)}: {type(r).__name__}. Return a part of"
            " the tree itself (pass multiple=True to return several)."
          )
      return paths

    selection = self._narrow(find)
    _check_disjoint(selection._paths)
    return selection

  def at_instances_of(self, cls: type | tuple[type, ...], innermost: bool = False) -> Selection:
    """Selects the outermost (or innermost) subtrees that are instances of `cls`.

    Example:
      >>> import flaxlens as fl
      >>> fl.select({"a": (1, 2.0), "b": 3.0}).at_instances_of(float).expect().get_sequence()
      (2.0, 3.0)
    """
    return self._search(lambda _, node: isinstance(node, cls), innermost)

  def at_calls_of(
    self, module_class: type | tuple[type, ...], innermost: bool = False
  ) -> Selection:
    """Selects the outermost (or innermost) calls of modules of `module_class`.

    A call matches when its Flax module (Linen or NNX) is an instance of `module_class`,
    subclasses included: `at_calls_of(nn.Dense)` selects the calls of every `nn.Dense`.

    Example:
      >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
      >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
      >>> x = jnp.ones((1, 3))
      >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
      >>> [n.where() for n in tree.select().at_calls_of(nn.Dense).get_sequence()]
      ['layers_0.__call__', 'layers_2.__call__']

      The same reads the same on an NNX model:

      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu)
      >>> tree = fl.unflaxify(model, x)
      >>> [n.where() for n in tree.select().at_calls_of(nnx.Linear).get_sequence()]
      ['layers/0.__call__']
    """

    def hit(_: KeyPath, node: Any) -> bool:
      # A call node (flaxlens.CallNode) tells its module's class by `module_type`.
      kind = getattr(node, "module_type", None) if hasattr(node, "submodule_calls") else None
      return isinstance(kind, type) and issubclass(kind, module_class)

    return self._search(hit, innermost)

  def at_subtrees_where(
    self,
    predicate: Callable[..., bool],
    with_keypath: bool = False,
    innermost: bool = False,
  ) -> Selection:
    """Selects the outermost (or innermost) subtrees for which `predicate` holds.

    With `with_keypath=True` the predicate is called as `predicate(keypath, node)`,
    the key path being from the root of the whole tree.
    """
    _check_callable(predicate, "at_subtrees_where")
    if with_keypath:
      return self._search(lambda path, node: bool(predicate(path, node)), innermost)
    return self._search(lambda _, node: bool(predicate(node)), innermost)

  def at_keypaths(self, keypaths: Iterable[KeyPath]) -> Selection:
    """Selects nodes at the given key paths, relative to each selected node."""
    keypaths = [tuple(k) for k in keypaths]

    def find(path: KeyPath, node: Any) -> list[KeyPath]:
      for rel in keypaths:
        try:
          _get(node, rel)
        except KeyError:
          raise SelectionError(
            f"Selection.at_keypaths: no node at {_format_path(path + rel)}."
          ) from None
      return [path + rel for rel in keypaths]

    selection = self._narrow(find)
    _check_disjoint(selection._paths)
    return selection

  def at_path(self, pattern: str) -> Selection:
    """Selects converted Flax calls by readable module path, glob patterns allowed.

    A call node answers to its module path (`"Block_3/Dense_0"`) and to its path with
    the method (`"Block_3/Dense_0.__call__"`); `*` matches within a path segment and
    `**` across segments. The outermost matching calls are selected.

    Raises:
      ArgumentError: if `pattern` is not a str.
      SelectionError: if nothing matches, listing a few of the paths that exist.
    """
    check_type(
      pattern,
      str,
      "select().at_path",
      "pattern",
      "a path pattern (a str)",
      'Pass "Block_*/Dense_0".',
    )

    def hit(_: KeyPath, node: Any) -> bool:
      readable = getattr(node, "readable_path", None)
      if not callable(readable):
        return False
      path, method = readable()
      return path_matches(pattern, path) or path_matches(pattern, f"{path}.{method}")

    selection = self._search(hit, innermost=False)
    if not selection._paths:
      known = sorted(
        {
          ".".join(node.readable_path())
          for _, node in _walk(self._root)
          if callable(getattr(node, "readable_path", None))
        }
      )
      raise SelectionError(
        f"No call matches the path pattern {pattern!r}. Known calls include: {known[:12]}"
      )
    return selection

  def where(self, predicate: Callable[..., bool], with_keypath: bool = False) -> Selection:
    """Keeps only the selected nodes for which `predicate` holds."""
    _check_callable(predicate, "where")
    kept = [
      p
      for p in self._paths
      if (predicate(p, _get(self._root, p)) if with_keypath else predicate(_get(self._root, p)))
    ]
    return Selection(self._root, kept)

  def expect(self, count: int | None = None) -> Selection:
    """Returns this selection if it holds `count` nodes (default: at least one).

    Narrowing methods may select nothing, and editing an empty selection changes
    nothing; put `.expect()` before an edit to make a selection that went wrong (a
    class the tree does not use, a predicate that never holds) an error instead.
    `at_path` does this check already.

    Raises:
      SelectionError: if no node is selected, or not exactly `count`.

    Example:
      >>> import flaxlens as fl
      >>> fl.select({"a": 1.0, "b": 2}).at_instances_of(float).expect().set(0.0)
      {'a': 0.0, 'b': 2}
      >>> fl.select({"a": 1.0}).at_instances_of(str).expect()
      Traceback (most recent call last):
      ...
      flaxlens.errors.SelectionError: The selection of a dict is empty, but at least one...
    """
    found = len(self._paths)
    if found > 0 if count is None else found == count:
      return self
    where = getattr(self._root, "where", None)  # A call node names itself.
    if callable(where):
      subject = f"{where()}: the selection"
    else:
      subject = f"The selection of a {type(self._root).__name__}"
    state = "is empty" if not found else f"holds {found} nodes"
    wanted = "at least one node" if count is None else f"exactly {count} node(s)"
    raise SelectionError(
      f"{subject} {state}, but {wanted} was expected. Check what you selected with (the"
      " class, predicate or path), or drop .expect() if selecting nothing is fine."
    )

  def deselect(self) -> Any:
    """Returns the whole tree, unchanged."""
    return self._root

  # --- reading -------------------------------------------------------------------

  def count(self) -> int:
    """Number of selected nodes."""
    return len(self._paths)

  def get_sequence(self) -> tuple[Any, ...]:
    """The selected nodes, in tree order."""
    return tuple(_get(self._root, p) for p in self._paths)

  def get_by_path(self) -> dict[KeyPath, Any]:
    """The selected nodes keyed by their key paths."""
    return {p: _get(self._root, p) for p in self._paths}

  def get(self) -> Any:
    """The single selected node.

    Raises:
      SelectionError: if the selection holds zero or several nodes.
    """
    if len(self._paths) != 1:
      raise SelectionError(
        f"Selection.get needs exactly one selected node, but {len(self._paths)} are"
        f" selected: {[_format_path(p) for p in self._paths[:8]]}. Narrow the"
        " selection, or use get_sequence()."
      )
    return _get(self._root, self._paths[0])

  # --- editing -------------------------------------------------------------------

  def apply(self, fn: Callable[..., Any], with_keypath: bool = False) -> Any:
    """Replaces each selected node by `fn(node)` (or `fn(keypath, node)`).

    Returns the new tree; the original is not modified.
    """
    _check_callable(fn, "apply")
    updates = {}
    for p in self._paths:
      node = _get(self._root, p)
      updates[p] = fn(p, node) if with_keypath else fn(node)
    return _replace(self._root, updates) if updates else self._root

  def set(self, value: Any) -> Any:
    """Replaces every selected node by `value`; returns the new tree."""
    return self.apply(lambda _: value)

  def insert_before(self, value: Any) -> Any:
    """Inserts `value` before each selected node in its parent list or tuple."""
    return self._edit_parents(lambda items, i: items[:i] + [value] + items[i:], "insert_before")

  def insert_after(self, value: Any) -> Any:
    """Inserts `value` after each selected node in its parent list or tuple."""
    return self._edit_parents(
      lambda items, i: items[: i + 1] + [value] + items[i + 1 :], "insert_after"
    )

  def remove_from_parent(self) -> Any:
    """Removes each selected node from its parent list, tuple or dict."""
    return self._edit_parents(None, "remove_from_parent")

  def _edit_parents(self, edit: Callable[[list, int], list] | None, method: str) -> Any:
    by_parent: dict[KeyPath, list[Any]] = {}
    for p in self._paths:
      if not p:
        raise SelectionError(f"Selection.{method}: the root of the tree has no parent.")
      by_parent.setdefault(p[:-1], []).append(p[-1])
    updates = {}
    for parent_path, keys in by_parent.items():
      parent = _get(self._root, parent_path)
      where = _format_path(parent_path)
      if isinstance(parent, dict) and edit is None:
        drop = {k.key for k in keys}
        updates[parent_path] = type(parent)((k, v) for k, v in parent.items() if k not in drop)
        continue
      if type(parent) not in (list, tuple):
        raise ArgumentError(
          f"Selection.{method}: the parent at {where} is a {type(parent).__name__};"
          " only lists and tuples (and dicts, for removal) support this."
        )
      items = list(parent)
      for idx in sorted((k.idx for k in keys), reverse=True):
        items = items[:idx] + items[idx + 1 :] if edit is None else edit(items, idx)
      updates[parent_path] = type(parent)(items)
    return _replace(self._root, updates)


def _search(
  node: Any, path: KeyPath, hit: Callable[[KeyPath, Any], bool], innermost: bool
) -> Iterable[KeyPath]:
  """Paths of matching subtrees: outermost matches, or innermost ones."""
  matched = hit(path, node)
  if matched and not innermost:
    yield path
    return
  inner: list[KeyPath] = []
  level = _children(node)
  if level is not None:
    for key, child in level[0]:
      inner.extend(_search(child, path + (key,), hit, innermost))
  if matched and not inner:
    yield path
  else:
    yield from inner


def _check_disjoint(paths: Sequence[KeyPath]) -> None:
  ordered = sorted(paths, key=len)
  for i, short in enumerate(ordered):
    for long in ordered[i + 1 :]:
      if long[: len(short)] == short:
        raise SelectionError(
          f"Selected nodes overlap: {_format_path(short)} contains {_format_path(long)}."
        )


_GLOB_REGEX = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}


def path_matches(pattern: str, path: str) -> bool:
  """Glob match in which `**` spans path segments and `*` and `?` stay within one.

  `**/` also matches no segment at all, so `**/Dense_0` matches a top-level `Dense_0`.
  """
  tokens = re.split(r"(\*\*/|\*\*|\*|\?)", pattern)
  regex = "".join(_GLOB_REGEX.get(token, re.escape(token)) for token in tokens)
  return re.fullmatch(regex, path) is not None


def select(tree: Any) -> Selection:
  """Starts a selection of `tree` whose only selected node is the root.

  Example:
    >>> import flaxlens as fl
    >>> fl.select([1, [2, 3]]).at(lambda t: t[1][0]).set(20)
    [1, [20, 3]]
  """
  return Selection(tree, [()])
