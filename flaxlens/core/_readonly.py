"""ReadOnlyDict: the dicts inside a converted tree, which refuse to change in place.

A converted tree is an immutable value: its nodes are frozen structs, and the dicts they
hold (`submodule_calls`, and the `parameters`, `variables` and `immutable_variables` of
their scope data) are `ReadOnlyDict`s. Reading is a plain dict's; every method that would
change one in place raises `ArgumentError` with the way to edit instead. Because nothing
can change inside them unseen, `fl.variable_jit` need not re-check them on every call
(`_jit._collect` skips them), which is most of what a jitted call of a tree costs on the
host. A dict a user puts into a tree by hand stays an ordinary dict and is watched.

It is a JAX pytree with a dict's flattening: children in sorted key order, keyed by
`DictKey`, so paths, selections and `jax.tree_util` read it exactly as a dict, and
rebuilding it (`tree_map`, `Selection.set`) gives a `ReadOnlyDict` again. No Flax
internals here.
"""

from __future__ import annotations

import operator
from typing import Any, NoReturn

import jax

from flaxlens.errors import ArgumentError


class ReadOnlyDict(dict):
  """A dict that refuses in-place changes; the dicts of a converted tree are these.

  Example:
    >>> from flaxlens.core._readonly import ReadOnlyDict
    >>> d = ReadOnlyDict(kernel=1)
    >>> d["kernel"], d == {"kernel": 1}
    (1, True)
    >>> d["bias"] = 0
    Traceback (most recent call last):
    ...
    flaxlens.errors.ArgumentError: The dicts of a converted tree are read-only ...
  """

  # `(children, keys)`, what flattening returns: made once, with the dict (which never
  # changes), and read by JAX with `operator.attrgetter` (C, no Python frame): a tree
  # passed to a plain `jax.jit` function is flattened at every call.
  __slots__ = ("_flaxlens_flat",)

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    try:
      keys = tuple(sorted(self))
    except TypeError as e:
      raise ArgumentError(
        f"The keys of a converted tree's dict must be sortable, as JAX orders a dict's"
        f" children by key; got {list(self)!r} ({e}). Use keys of one type (strings)."
      ) from None
    self._flaxlens_flat = (tuple(map(self.__getitem__, keys)), keys)

  def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
    raise ArgumentError(
      "The dicts of a converted tree are read-only (they cannot change in place: a tree is"
      " a value, and fl.variable_jit reuses its split while it lives). Edit a copy instead:"
      " tree.select().at(...).set(new) or .apply(fn), or"
      " dataclasses.replace(node, field={**old, key: new}); to change a parameter's value,"
      " assign its .value."
    )

  __setitem__ = __delitem__ = __ior__ = _refuse
  clear = pop = popitem = setdefault = update = _refuse

  def __reduce__(self) -> tuple[Any, ...]:  # copy, deepcopy, pickle: built whole, never set
    return type(self), (dict(self),)


def _flatten_with_keys(d: ReadOnlyDict) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
  children, keys = d._flaxlens_flat
  return [(jax.tree_util.DictKey(k), c) for k, c in zip(keys, children, strict=True)], keys


def _unflatten(keys: tuple[Any, ...], children: Any) -> ReadOnlyDict:
  return ReadOnlyDict(zip(keys, children, strict=True))


jax.tree_util.register_pytree_with_keys(
  ReadOnlyDict, _flatten_with_keys, _unflatten, operator.attrgetter("_flaxlens_flat")
)


def read_only(d: dict[Any, Any]) -> ReadOnlyDict:
  """`d` as a `ReadOnlyDict`, and the plain dicts among its values too."""
  return ReadOnlyDict((k, read_only(v) if type(v) is dict else v) for k, v in d.items())
