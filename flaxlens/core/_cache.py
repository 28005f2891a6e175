"""Values kept on the frozen objects they are derived from: the one rule for every cache.

A converted tree never changes in place, so what a run works out from a node's structure
(the variables it gathers, whether its calls were replaced, a node's call specs by key,
a struct's treedef entries) can be worked out once and kept on the node. `Derived` is
the only way flaxlens keeps such a value; the rule, stated once:

- What may be kept: a value determined by the object and by objects that never change
  in place (frozen structs, read-only dicts, static fields); where that holds only for
  some objects (a hand-built node may hold a plain dict), `lasting` says for which, and
  the value is worked out again at every use for the others. Also a resource that
  belongs to the object alone (the NNX idle-copy pool), which no other object shares.
- What is never kept: variable values, anything read from JAX's trace state or from
  arguments of a call, and anything read through a container that can change.
- Lifetime: the object's own. A new object starts empty: `dataclasses.replace`,
  `tree_unflatten` (which may `seed` what it knows), and `copy.copy`, `copy.deepcopy`
  and pickling of a `Struct` (whose state leaves the kept values out).

A value is kept in the object's `__dict__` under `_flaxlens_<name>` (set with
`object.__setattr__`, as the object is frozen). A `Derived` is either called on an object
(`GATHERED(root)`), or declared as a class attribute named `_flaxlens_<name>`, where,
once kept, reading it is a plain attribute read (the hot path of flattening a struct).
No Flax internals here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

PREFIX = "_flaxlens_"


class Derived(Generic[T]):
  """A value derived from a frozen object, worked out on first use and kept on it.

  Args:
    name: what the value is; it is kept as the attribute `_flaxlens_<name>`.
    compute: `compute(obj)`, the value.
    lasting: `lasting(obj, value)`, whether the value can be kept (None: always). It is
      asked only when the value is worked out.

  Example:
    >>> import flaxlens as fl
    >>> from flaxlens.core._cache import Derived
    >>> class Pair(fl.Struct):
    ...   left: int
    ...   right: int
    >>> TOTAL = Derived("total", lambda pair: pair.left + pair.right)
    >>> pair = Pair(1, 2)
    >>> TOTAL(pair), TOTAL.kept(pair), TOTAL.kept(Pair(3, 4))
    (3, 3, None)
  """

  __slots__ = ("attribute", "compute", "lasting")

  def __init__(
    self,
    name: str,
    compute: Callable[[Any], T],
    lasting: Callable[[Any, T], bool] | None = None,
  ):
    self.attribute = PREFIX + name
    self.compute = compute
    self.lasting = lasting

  def __call__(self, obj: Any) -> T:
    """The value for `obj`: the kept one, or worked out (and kept if it lasts)."""
    try:
      return obj.__dict__[self.attribute]
    except KeyError:
      pass
    value = self.compute(obj)
    if self.lasting is None or self.lasting(obj, value):
      object.__setattr__(obj, self.attribute, value)
    return value

  def kept(self, obj: Any) -> T | None:
    """The value kept on `obj`, or None if none is."""
    return obj.__dict__.get(self.attribute)

  def seed(self, obj: Any, value: T) -> None:
    """Keeps `value`, known to be what `compute(obj)` would return, on a new `obj`."""
    object.__setattr__(obj, self.attribute, value)

  def __set_name__(self, owner: type, name: str) -> None:
    if name != self.attribute:
      raise TypeError(f"A Derived named {self.attribute!r} is declared as {name!r}.")

  def __get__(self, obj: Any, owner: type | None = None) -> Any:
    # Only while nothing is kept: a kept value in the instance's `__dict__` shadows this
    # (non-data) descriptor.
    if obj is None:
      return self
    return self(obj)


def without_kept(state: dict[str, Any]) -> dict[str, Any]:
  """An object's `__dict__` without the values `Derived` kept in it (for copies)."""
  return {k: v for k, v in state.items() if not k.startswith(PREFIX)}
