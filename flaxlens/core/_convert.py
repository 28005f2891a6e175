"""What every converter shares: recording the calls of one abstract run, building nodes.

A converter (`flaxlens.linen`, `flaxlens.nnx`) runs its model once under `jax.eval_shape`
while a building interceptor records every call into `CallRecord`s (`record_calls`), so
conversion costs no FLOPs and copies no buffers; Python values among the inputs stay
Python values (`split_static`). It then turns the records into nodes (`build_nodes`),
all sharing one fresh `origin`. No Flax internals here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._call_failure import explain_conversion
from flaxlens.core._call_record import CallRecord, converting
from flaxlens.core._calls import CallInterceptor, Frame
from flaxlens.core._node import CallNode, new_origin
from flaxlens.core._readonly import ReadOnlyDict


def record_calls(
  root: CallRecord,
  new_interceptor: Callable[[], CallInterceptor],
  run: Callable[[CallInterceptor, Any], Any],
  inputs: Any,
  example: ArgsAndKwargs,
) -> Any:
  """Runs `run(interceptor, inputs)` abstractly, recording its calls under `root`.

  The array leaves of `inputs` become abstract (`jax.ShapeDtypeStruct`s traced by
  `jax.eval_shape`); `run` makes the interceptor active around the native call. Returns
  what `run` returns, abstractly. An error of the model's own code on `example` (the
  example call's arguments) is raised as a `ModelCallError` naming the failing call.
  """
  arrays, rebuild = split_static(inputs)
  method = root.method_name

  def trace(arrays: list[Any]) -> Any:
    interceptor = new_interceptor()
    root.children.clear()
    interceptor.frames[:] = [Frame((), record=root, absorb=interceptor.reported_name(method))]
    return run(interceptor, rebuild(arrays))

  with converting(root):
    try:
      return jax.eval_shape(trace, arrays)
    except Exception as e:  # Free unless raised: explained only after a failure.
      explained = explain_conversion(root, example, e)
      if explained is None:
        raise
      raise explained from e


def split_static(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
  """Array leaves of `tree`, and a function rebuilding `tree` from new array leaves.

  Example:
    >>> import jax.numpy as jnp
    >>> from flaxlens.core._convert import split_static
    >>> arrays, rebuild = split_static({"x": jnp.ones(2), "train": True})
    >>> len(arrays), rebuild([jnp.zeros(2)])["train"]
    (1, True)
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  mask = [isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct) for x in leaves]

  def rebuild(arrays: list[Any]) -> Any:
    it = iter(arrays)
    return jax.tree_util.tree_unflatten(
      treedef, [next(it) if m else leaf for leaf, m in zip(leaves, mask, strict=True)]
    )

  return [x for x, m in zip(leaves, mask, strict=True) if m], rebuild


def build_nodes(
  root: CallRecord, make: Callable[[CallRecord, dict[Any, CallNode], int], CallNode]
) -> CallNode:
  """The node tree of the records under `root`: `make(record, children, origin)` each."""
  origin = new_origin()

  def build(record: CallRecord) -> CallNode:
    return make(record, ReadOnlyDict((key, build(child)) for key, child in record.children), origin)

  return build(root)
