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

  __slots__ = ()

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
  keys = tuple(sorted(d))
  return [(jax.tree_util.DictKey(k), d[k]) for k in keys], keys


def _flatten(d: ReadOnlyDict) -> tuple[list[Any], tuple[Any, ...]]:
  keys = tuple(sorted(d))
  return [d[k] for k in keys], keys


def _unflatten(keys: tuple[Any, ...], children: Any) -> ReadOnlyDict:
  return ReadOnlyDict(zip(keys, children, strict=True))


jax.tree_util.register_pytree_with_keys(ReadOnlyDict, _flatten_with_keys, _unflatten, _flatten)


def read_only(d: dict[Any, Any]) -> ReadOnlyDict:
  """`d` as a `ReadOnlyDict`, and the plain dicts among its values too."""
  return ReadOnlyDict((k, read_only(v) if type(v) is dict else v) for k, v in d.items())
