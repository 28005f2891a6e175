"""Budgets: how many examples of a batch fit a number of bytes, and a batch split into chunks.

A budget bounds the bytes that the values one compiled call returns (captures, a harvest)
take on the device. What a call returns is worked out from its abstract evaluation
(`jax.eval_shape`: shapes only, no FLOPs) at the whole batch and at one example: each
returned array either grows with the batch along one axis (so many rows per example) or
does not grow at all, which gives the bytes per example and the bytes every chunk holds
whatever its size. A batch is split along the leading axis of the model's array
arguments, which must all have the same size; every chunk has the same size, so one
compiled program runs them all (the last chunk is the last `size` examples, overlapping
the one before, and only its new rows are kept). Chunks are joined on the host (NumPy).
No Flax internals here.

The functions are shared by every tool that bounds what it returns (`fl.capture`,
`fl.sweep`, harvests): `arrays_of`, `batch_size`, `take`, `examples`, `shrunk`, `abstractly`,
`layout`, `examples_per_chunk`, `starts`, `joined`, `check_independent` (with
`shared_differences`), `varying`, `differences`, `nbytes`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.errors import BudgetError
from flaxlens.tools.base._index import MASK, is_array


def _less(where: str) -> str:
  """How to capture less, in the options of the tool `where` names."""
  return (
    "fewer sites, positions=, dtype="
    if where.startswith("fl.harvest")
    else ("fewer sites, index=, dtype=")
  )


def _part(where: str) -> str:
  if where.startswith("fl.harvest"):
    return 'positions= ("last", or a mask)'
  return "index= (jnp.s_[:, -1]: the last position)"


def checked_budget(budget: Any, where: str) -> int | None:
  """`budget` as a positive number of bytes, or None; anything else refused naming `where`.

  Example:
    >>> checked_budget(2**20, "fl.capture")
    1048576
  """
  if budget is None:
    return None
  if isinstance(budget, bool) or not isinstance(budget, int | np.integer) or budget < 1:
    raise BudgetError(
      f"{where}: budget= is a positive number of bytes (an int, such as 2**30 for 1 GiB),"
      f" got {budget!r}. Pass an int, or None for no budget."
    )
  return int(budget)


def nbytes(tree: Any) -> int:
  """The bytes the arrays of `tree` take (arrays or `jax.ShapeDtypeStruct`s).

  Example:
    >>> import jax.numpy as jnp
    >>> nbytes({"a": jnp.zeros((2, 3)), "b": jax.ShapeDtypeStruct((4,), jnp.int8)})
    28
  """
  return sum(_leaf_bytes(x) for x in jax.tree_util.tree_leaves(tree))


def _leaf_bytes(x: Any) -> int:
  if not is_array(x):
    return 0
  return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def arrays_of(argument: ArgsAndKwargs) -> list[tuple[str, Any]]:
  """`(name, array)` for each array among a call's arguments, named as the call reads
  them (`args[0]`, `kwargs['mask']`, `args[1][0]`).

  Example:
    >>> import jax.numpy as jnp
    >>> [n for n, _ in arrays_of(ArgsAndKwargs.capture(jnp.ones(2), 3, mask=jnp.ones(2)))]
    ['args[0]', "kwargs['mask']"]
  """
  leaves = jax.tree_util.tree_leaves_with_path((argument.args, argument.kwargs))
  out = []
  for path, leaf in leaves:
    if is_array(leaf):
      where = "args" if path[0].idx == 0 else "kwargs"
      out.append((where + jax.tree_util.keystr(path[1:]), leaf))
  return out


def batch_size(argument: ArgsAndKwargs, where: str) -> int:
  """The size of the leading axis that every array among the arguments shares.

  Raises:
    BudgetError: no argument is an array, or they do not share one leading size (each
      is named with its shape).

  Example:
    >>> import jax.numpy as jnp
    >>> batch_size(ArgsAndKwargs.capture(jnp.ones((8, 4)), mask=jnp.ones((8,))), "fl.capture")
    8
  """
  arrays = arrays_of(argument)
  if not arrays:
    raise BudgetError(
      f"{where}: the captures exceed the budget, and the model's arguments hold no array to"
      f" split into chunks. Capture less ({_less(where)}) or give a larger budget."
    )
  sizes = {x.shape[0] if x.ndim else None for _, x in arrays}
  if len(sizes) != 1 or None in sizes:
    shapes = ", ".join(f"{name}: {tuple(x.shape)}" for name, x in arrays)
    raise BudgetError(
      f"{where}: the captures exceed the budget, so the batch would be split along the leading"
      f" axis of the model's array arguments, and these do not share one leading size"
      f" ({shapes}). Give every array argument the batch as its first axis (make other"
      f" arrays attributes of the model), or capture less ({_less(where)})."
    )
  return int(sizes.pop())


def picks_examples(index: Any) -> bool:
  """Whether the static form of an index (`_index.split`) selects along the leading axis
  (an int, an integer array or a partial slice there): applied to each chunk on its own,
  it would select in every chunk what it selects once in the whole batch. A mask, or an
  index starting with `...` or a full slice, does not.

  Example:
    >>> from flaxlens.tools.base._index import split
    >>> picks_examples(split((0, 3))[0]), picks_examples(split((slice(None), 3))[0])
    (True, False)
  """
  if index is None or index == MASK:
    return False
  entries = [entry for entry in index[1:] if entry[0] != "newaxis"]
  if not entries or entries[0][0] == "ellipsis":
    return False
  kind, *bounds = entries[0]
  return kind != "slice" or tuple(bounds) not in (
    (None, None, None),
    (0, None, None),
    (None, None, 1),
    (0, None, 1),
  )


def examples(start: int, size: int, batch: int) -> np.ndarray:
  """The indices of examples `start` to `start + size` of a batch, the ones past its end
  repeating its last example (int32, as `take` takes them).

  Example:
    >>> examples(1, 3, 3).tolist()
    [1, 2, 2]
  """
  return np.minimum(np.arange(start, start + size), batch - 1).astype(np.int32)


def take(argument: ArgsAndKwargs, indices: Any) -> ArgsAndKwargs:
  """The arguments of the examples at `indices` (every array indexed along its leading
  axis). Works inside a trace, with `indices` traced: one program serves every chunk of
  a size.

  Example:
    >>> import jax.numpy as jnp
    >>> take(ArgsAndKwargs.capture(jnp.arange(6), train=False), examples(4, 2, 6)).args[0].tolist()
    [4, 5]
  """

  def taken(x: Any) -> Any:
    return jax.numpy.take(x, indices, axis=0) if is_array(x) else x

  return jax.tree_util.tree_map(taken, argument)


def shrunk(argument: ArgsAndKwargs, size: int) -> ArgsAndKwargs:
  """The arguments' abstract form with `size` examples (`jax.ShapeDtypeStruct`s)."""

  def abstract(x: Any) -> Any:
    if not is_array(x):
      return x
    return jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype)

  return jax.tree_util.tree_map(abstract, argument)


def abstractly(fn: Callable[[ArgsAndKwargs], Any], argument: ArgsAndKwargs) -> Any:
  """`jax.eval_shape` of `fn(argument)`: only the array leaves of `argument` are abstract
  (Python values such as `train=False` stay as they are); shapes only, no FLOPs."""
  leaves, treedef = jax.tree_util.tree_flatten(argument)
  positions = [i for i, x in enumerate(leaves) if is_array(x)]

  def run(arrays: list[Any]) -> Any:
    filled = list(leaves)
    for i, x in zip(positions, arrays, strict=True):
      filled[i] = x
    return fn(jax.tree_util.tree_unflatten(treedef, filled))

  shapes = [jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype) for i in positions]
  return jax.eval_shape(run, shapes)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the arrays a call returns grow with the batch, leaf by leaf.

  Attributes:
    treedef: the structure of what the call returns.
    axes: per leaf, the axis along which it grows with the batch, or None (it does not).
    rows: per leaf, how many entries along that axis one example adds (1 for None).
    names: per leaf, how messages name it (the key of the site, say).
    fixed: the bytes of the leaves that do not grow with the batch.
    per_example: the bytes one example adds.
  """

  treedef: Any
  axes: tuple[int | None, ...]
  rows: tuple[int, ...]
  names: tuple[str, ...]
  fixed: int
  per_example: int

  @classmethod
  def first_axis(cls, names: Sequence[str]) -> Layout:
    """The layout of a list of arrays named `names`, each holding one row per example
    along its first axis; for comparing and joining only (its bytes are not counted)."""
    n = len(names)
    return cls(jax.tree_util.tree_structure([0] * n), (0,) * n, (1,) * n, tuple(names), 0, 0)

  def sizes(self, one: Any) -> dict[str, int]:
    """Bytes per example by name (the names of leaves that grow), from the abstract value
    at one example."""
    totals: dict[str, int] = {}
    for name, axis, leaf in zip(self.names, self.axes, jax.tree_util.tree_leaves(one), strict=True):
      if axis is not None:
        totals[name] = totals.get(name, 0) + _leaf_bytes(leaf)
    return totals


def layout(
  at_batch: Any, at_one: Any, batch: int, where: str, name: Callable[[Any], str] = str
) -> Layout:
  """The `Layout` of what a call returns, from its abstract value at `batch` examples and
  at one (`batch > 1`); `name(path)` names a leaf from its key path in messages.

  Raises:
    BudgetError: the two differ in structure, or a leaf grows otherwise than by a fixed
      number of rows per example along one axis.
  """
  paths_b, treedef = jax.tree_util.tree_flatten_with_path(at_batch)
  leaves_1, treedef_1 = jax.tree_util.tree_flatten(at_one)
  if treedef != treedef_1:
    raise BudgetError(
      f"{where}: the run returns other values for one example than for the batch of {batch}"
      " (it takes another branch on the batch size), so the batch cannot be split. Capture"
      f" less ({_less(where)}) or give a larger budget."
    )
  axes, rows, names = [], [], []
  fixed = per_example = 0
  for (path, big), small in zip(paths_b, leaves_1, strict=True):
    label = name(path)
    names.append(label)
    big_shape, small_shape = tuple(np.shape(big)), tuple(np.shape(small))
    differ = [i for i, (a, b) in enumerate(zip(big_shape, small_shape, strict=False)) if a != b]
    if big_shape == small_shape:
      axes.append(None)
      rows.append(1)
      fixed += _leaf_bytes(big)
      continue
    if (
      len(big_shape) != len(small_shape)
      or len(differ) != 1
      or big_shape[differ[0]] != batch * small_shape[differ[0]]
    ):
      raise BudgetError(
        f"{where}: {label} has shape {big_shape} for the batch of {batch} and {small_shape}"
        " for one example: it does not grow by whole rows per example along one axis, so"
        " chunks of the batch cannot be joined into it. Leave it out of what you capture,"
        " or give a larger budget."
      )
    axes.append(differ[0])
    rows.append(small_shape[differ[0]])
    per_example += _leaf_bytes(small)
  return Layout(treedef, tuple(axes), tuple(rows), tuple(names), fixed, per_example)


def examples_per_chunk(
  per_example: int, fixed: int, sizes: dict[str, int], budget: int, batch: int, where: str
) -> int:
  """The most examples (at most `batch`) whose returned values fit `budget` bytes, each
  example taking `per_example` bytes besides `fixed` bytes that do not grow with the batch;
  `sizes` gives the bytes per example by name, for the message.

  Raises:
    BudgetError: not even one example fits; the message lists the bytes per example of
      each name (largest first) and the fixes.

  Example:
    >>> examples_per_chunk(100, 50, {"Block_0": 100}, 1_000, 64, "fl.capture")
    9
  """
  room = budget - fixed
  if room < 0 or room < per_example:
    ranked = sorted(sizes.items(), key=lambda item: -item[1])
    listed = ", ".join(f"{k}: {v:,}" for k, v in ranked[:8])
    more = f" and {len(ranked) - 8} more" if len(ranked) > 8 else ""
    raise BudgetError(
      f"{where}: the budget does not hold the captures of one example: {per_example:,}"
      f" bytes per example ({listed}{more}), besides {fixed:,} bytes that do not grow with"
      f" the batch. Capture fewer sites, keep part of each value with {_part(where)}, cast"
      f" with dtype= (jnp.bfloat16), or give a budget of at least {fixed + per_example:,}"
      " bytes."
    )
  if per_example == 0 or room >= batch * per_example:
    return batch
  return room // per_example


def starts(batch: int, size: int) -> list[int]:
  """Where each chunk of `size` examples starts: equal chunks, the last one ending at the
  end of the batch (overlapping the one before when `size` does not divide `batch`).

  Example:
    >>> starts(7, 3)
    [0, 3, 4]
  """
  out = list(range(0, batch - size + 1, size))
  if out[-1] + size < batch:
    out.append(batch - size)
  return out


def joined(chunks: Sequence[Any], chunk_starts: Sequence[int], size: int, plan: Layout) -> Any:
  """The chunks' values (host arrays, as `starts(batch, size)` cut them) joined into the
  values of the whole batch: leaves that grow are concatenated along their axis, each
  chunk giving the rows of its examples not given before; the others are the first
  chunk's."""
  flat = [jax.tree_util.tree_leaves(c) for c in chunks]
  leaves = []
  for k, (axis, rows) in enumerate(zip(plan.axes, plan.rows, strict=True)):
    if axis is None:
      leaves.append(flat[0][k])
      continue
    parts, end = [], 0
    for start, values in zip(chunk_starts, flat, strict=True):
      skip = (end - start) * rows
      parts.append(np.take(values[k], np.arange(skip, size * rows), axis=axis))
      end = start + size
    leaves.append(np.concatenate(parts, axis=axis))
  return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def shared_differences(first: Any, second: Any, size: int, plan: Layout) -> list[str]:
  """The names of the leaves whose rows 1 to `size - 1` (the examples both chunks hold,
  at the same rows) differ between two chunks of `size` examples that differ in their
  first example only; leaves that do not grow are compared whole.

  Run by one program, an example computed independently of the others in its chunk has
  the same bits in both (the same operations on the same values at the same rows);
  a model that normalises over the batch or mixes examples gives other values.
  """
  out = []
  pairs = zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second), strict=True)
  for (x, y), name, axis, rows in zip(pairs, plan.names, plan.axes, plan.rows, strict=True):
    if axis is not None:
      x = np.take(x, np.arange(rows, size * rows), axis=axis)
      y = np.take(y, np.arange(rows, size * rows), axis=axis)
    if differences(x, y, [name]):
      out.append(name)
  return out


def check_independent(
  chunk: Callable[[tuple[int, ...]], Sequence[Any]],
  plans: Sequence[Layout],
  size: int,
  batch: int,
  where: str,
  *,
  exceeding: str,
  fix: str,
  named: Callable[[list[str]], str] = lambda found: found[0],
) -> None:
  """Refuses to split a batch into chunks of `size` unless a chunk's examples are computed
  independently of each other.

  `chunk(indices)` runs the batch's examples at `indices` and returns one host value per
  layout of `plans`. The first chunk, and the same chunk with its first example replaced
  by another (the next example after it, or a copy of its second), must give the same
  bits for the examples both hold, at the same rows (`shared_differences`). Chunks hold
  at least two examples: where `size` is 1 the check's chunks hold two.

  Raises:
    BudgetError: a value differs: the model couples the examples of a batch (it
      normalises over the batch or mixes examples). The message says what exceeds the
      budget (`exceeding`, such as "the captures"), names `named(found)` of the values
      that differ (the first by default), and ends with `fix`.
  """
  checked = max(size, 2)
  first = tuple(range(checked))
  second = (checked if checked < batch else 1, *first[1:])
  a, b = chunk(first), chunk(second)
  found = [
    name
    for x, y, plan in zip(a, b, plans, strict=True)
    for name in shared_differences(x, y, checked, plan)
  ]
  if found:
    raise BudgetError(
      f"{where}: {exceeding} exceed the budget, so the batch would be split into chunks of"
      f" {size}, and {named(found)} of an example changes when another example of its"
      " chunk changes: the model couples the examples of a batch (it normalises over the"
      f" batch or mixes examples), so chunks would not give the whole batch's values. {fix}"
    )


def varying(chunks: Sequence[Any], plan: Layout) -> str | None:
  """The name of the first leaf that does not grow with the batch and yet differs between
  chunks (host values), or None: such a leaf has no single value for the whole batch."""
  flat = [jax.tree_util.tree_leaves(c) for c in chunks]
  for k, (name, axis) in enumerate(zip(plan.names, plan.axes, strict=True)):
    if axis is None and any(differences(f[k], flat[0][k], [name]) for f in flat[1:]):
      return name
  return None


def differences(a: Any, b: Any, names: Sequence[str]) -> list[str]:
  """The names of the leaves (in order) whose bits differ between `a` and `b` (host
  pytrees of one structure); empty when they are identical.

  Example:
    >>> import numpy as np
    >>> differences({"a": np.ones(2), "b": np.zeros(2)}, {"a": np.ones(2), "b": np.ones(2)}, "ab")
    ['b']
  """
  out = []
  for name, x, y in zip(
    names, jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True
  ):
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
      out.append(name)
  return out
