"""`CallSpec`: what conversion saw of one submodule call, and the check of a replacement's output.

Arguments and outputs are kept abstractly (structure, static values, dtypes and shapes),
so recording costs nothing; `CallSpec.check` refuses a replacement output the original
call could not have returned for the same kind of arguments. No Flax internals here.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from flaxlens.core._names import CallKey, Path


class _Opaque:
  """Stands for a non-array leaf that cannot be compared by value: only its type counts."""

  __slots__ = ("type",)

  def __init__(self, leaf_type: type):
    self.type = leaf_type

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Opaque) and other.type is self.type

  def __hash__(self) -> int:
    return hash(self.type)

  def __repr__(self) -> str:
    return f"<{self.type.__name__}>"


_PLAIN = (str, int, float, bool, complex, type(None))


def _summary(leaf: Any) -> Any:
  if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
    return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
  if type(leaf) in _PLAIN:
    return leaf
  return _Opaque(type(leaf))


def signature(tree: Any) -> tuple[Any, tuple[Any, ...]] | None:
  """`(treedef, leaf summaries)`: arrays as `ShapeDtypeStruct`s, plain values as is."""
  try:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
  except Exception:  # A pytree that cannot be flattened outside its context.
    return None
  return treedef, tuple(_summary(x) for x in leaves)


def _show(summary: Any) -> str:
  if isinstance(summary, jax.ShapeDtypeStruct):
    return f"{summary.dtype}{list(summary.shape)}"
  return repr(summary)


def _show_signature(signature: tuple[Any, tuple[Any, ...]]) -> str:
  treedef, leaves = signature
  shown = jax.tree_util.tree_unflatten(treedef, [_Shown(_show(x)) for x in leaves])
  return repr(shown)


def show_arguments(signature: tuple[Any, tuple[Any, ...]] | None) -> str:
  """`(int32[2, 8], train=True)`: the arguments a `signature` of `(args, kwargs)` holds.

  Example:
    >>> import jax.numpy as jnp
    >>> from flaxlens.core._spec import show_arguments, signature
    >>> show_arguments(signature(((jnp.ones((2, 3), jnp.int32),), {"train": True})))
    '(int32[2, 3], train=True)'
  """
  if signature is None:
    return "(arguments that cannot be described)"
  treedef, leaves = signature
  shown = jax.tree_util.tree_unflatten(treedef, [_Shown(_show(x)) for x in leaves])
  if not (isinstance(shown, tuple) and len(shown) == 2 and isinstance(shown[1], dict)):
    return repr(shown)
  args, kwargs = shown
  return f"({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"


class _Shown:
  __slots__ = ("text",)

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


class CallSpec:
  """What conversion saw of one submodule call: its module, arguments and output.

  Arrays are kept abstractly (`jax.ShapeDtypeStruct`), so recording costs nothing;
  inside `nn.scan`/`nn.vmap`/`nnx.vmap` bodies these are the per-iteration values the
  body sees, as replacements there see them.

  Attributes:
    key: the call's key in its caller's `submodule_calls`.
    path: the called module's path.
    method_name: the called method.
    inputs: `(treedef, leaf summaries)` of `(args, kwargs)` at conversion.
    output: `(treedef, leaf summaries)` of the call's output at conversion.
  """

  __slots__ = ("key", "path", "method_name", "inputs", "output", "_hash")

  def __init__(
    self, key: CallKey, path: Path, method_name: Any, args: Any, kwargs: Any, output: Any
  ):
    self.key = key
    self.path = path
    self.method_name = method_name
    self.inputs = signature((tuple(args), dict(kwargs)))
    self.output = signature(output)
    try:
      self._hash = hash((key, path, self.inputs, self.output))
    except TypeError:  # Unhashable static data in a treedef: hash the call alone.
      self._hash = hash((key, path))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    return self is other or (
      type(other) is CallSpec
      and self._hash == other._hash
      and _same_static(
        (self.key, self.path, self.inputs, self.output),
        (other.key, other.path, other.inputs, other.output),
      )
    )

  def __repr__(self) -> str:
    return f"CallSpec({self.key!r})"

  def continued_by(self, node: Any) -> bool:
    """Whether `node` stands for this call's module and method (its origin aside)."""
    return node.path == self.path and node.method_name == self.method_name

  def check(self, output: Any, args: Any, kwargs: Any) -> str | None:
    """What is wrong with `output` as this call's output for these arguments, or None.

    The rule: the output must be what the original call would return for these
    arguments, as far as conversion tells without running it again. The call's output
    depends on its arguments only through their structure, static (non-array) values,
    dtypes and shapes; so
    - if the arguments have the structure and static values seen at conversion, the
      output must have the structure seen at conversion;
    - if their arrays also have the dtypes and ranks seen at conversion, each output
      array must have the dtype (weak types aside) and rank seen at conversion;
    - if their arrays also have the very shapes seen at conversion, each output array
      must have the very shape seen at conversion.
    A call made with other kinds of arguments (another batch size, another flag) is
    checked only as far as its arguments agree, so legitimate call-time differences
    are never refused. (A call whose output shape depends on array *values* or on
    edited parameter shapes or dtypes is out of reach of the rule; flaxlens assumes it
    does not happen.)
    """
    if self.inputs is None or self.output is None:
      return None
    given = signature((tuple(args), dict(kwargs)))
    if given is None or not _same_static(given[0], self.inputs[0]):
      return None
    arrays = []
    for a, b in zip(given[1], self.inputs[1], strict=True):
      if isinstance(a, jax.ShapeDtypeStruct) or isinstance(b, jax.ShapeDtypeStruct):
        arrays.append((a, b))
      elif not _same_static(a, b):
        return None
    same_kind = all(
      isinstance(a, jax.ShapeDtypeStruct)
      and isinstance(b, jax.ShapeDtypeStruct)
      and a.dtype == b.dtype
      and len(a.shape) == len(b.shape)
      for a, b in arrays
    )
    same_shapes = same_kind and all(a.shape == b.shape for a, b in arrays)
    leaves, treedef = jax.tree_util.tree_flatten(output)

    def got() -> str:
      return _show_signature((treedef, tuple(_summary(x) for x in leaves)))

    if not _same_static(treedef, self.output[0]):
      return f"{got()}, where the call returns {_show_signature(self.output)} (another structure)"
    for leaf, want in zip(leaves, self.output[1], strict=True):
      if not isinstance(want, jax.ShapeDtypeStruct) or not same_kind:
        continue
      shape, dtype, weak = _leaf_type(leaf)
      wrong = len(shape) != len(want.shape) or (same_shapes and shape != want.shape)
      if wrong or (not weak and dtype != want.dtype):
        expected = _show_signature(self.output)
        return f"{got()}, where the call returns {expected} for these arguments"
    return None


def _same_static(a: Any, b: Any) -> bool:
  """Equality that is False for values of other types or that cannot be compared."""
  if type(a) is not type(b):
    return False
  try:
    return bool(a == b)
  except Exception:
    return False


def _leaf_type(leaf: Any) -> tuple[tuple[int, ...], Any, bool]:
  """Shape, dtype and whether the dtype is weak (Python scalars, weakly typed arrays)."""
  if type(leaf) in _PLAIN:
    return (), None, True
  shape = tuple(np.shape(leaf))
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    dtype = jax.dtypes.canonicalize_dtype(dtype)  # NumPy float64 is float32 to JAX.
  weak = bool(getattr(leaf, "weak_type", False))
  return shape, dtype, weak
