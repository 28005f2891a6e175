"""How the tools take a model's arguments: one value after the tree, their options after it.

`fl.run`, `fl.capture`, `fl.sweep`, `fl.attribute`, `fl.grad_at`, `fl.fold` and
`fl.check_equivalence` take the arguments of the model's call as one positional value:
one argument as itself, several positional arguments as a tuple, keyword arguments in an
`fl.ArgsAndKwargs`. Their own options are keyword-only. So no option name (`inputs=`,
`at=`, `jit=`, ...) can ever be taken for an argument of the model, and a model whose
call takes `inputs=` or `method=` runs like any other. `takes_model_arguments` turns a
call written the old way (the model's arguments spread over the tool's) into an
`ArgumentError` that shows the new one; it costs nothing when the call binds. The tools
that move values between a clean and a corrupted run check that the two runs' arguments
agree in structure and shapes (`check_matching_runs`) before anything is traced.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._checks import refuse
from flaxlens.core._spec import show_arguments, signature
from flaxlens.errors import ArgumentError

F = TypeVar("F", bound=Callable[..., Any])


def model_arguments(value: Any) -> ArgsAndKwargs:
  """The call's arguments from one value: `fl.ArgsAndKwargs`, a tuple, or one argument.

  Example:
    >>> model_arguments((1, 2)).args, model_arguments(3).args
    ((1, 2), (3,))
  """
  if isinstance(value, ArgsAndKwargs):
    return ArgsAndKwargs(args=tuple(value.args), kwargs=dict(value.kwargs))
  return ArgsAndKwargs(args=value if isinstance(value, tuple) else (value,), kwargs={})


def check_matching_runs(
  clean: ArgsAndKwargs,
  corrupted: ArgsAndKwargs,
  where: str,
  why: str,
  *,
  broadcast: bool = False,
) -> None:
  """Refuses clean and corrupted arguments that differ in structure or in an array's shape.

  `where` starts the message (`"fl.sweep of Net.__call__"`), `why` says what the tool
  does with the two runs' values. Python values other than numbers (`train=True`) are
  not compared: they may differ between the runs. With `broadcast`, a clean array may
  have a shape that broadcasts to the corrupted one's (one clean example against a batch
  of corrupted ones), as a tool moving clean values into the corrupted run allows.

  Example:
    >>> import jax.numpy as jnp
    >>> clean, corrupted = model_arguments(jnp.ones((2, 3))), model_arguments(jnp.ones((1, 3)))
    >>> try:
    ...   check_matching_runs(clean, corrupted, "fl.sweep", "It patches.")
    ... except ArgumentError as e:
    ...   print(str(e).split(": ", 2)[2].split(". ")[0])
    args[0] is float32[2, 3] in the clean run and float32[1, 3] in the corrupted run
  """
  fix = (
    "Give both runs arguments of the same structure and shapes (the same batch size and"
    " sequence length: pad the shorter inputs, or take as many examples for each run)."
  )
  flat = []
  for argument in (clean, corrupted):
    try:
      flat.append(jax.tree_util.tree_flatten_with_path((argument.args, argument.kwargs)))
    except Exception:  # A pytree that cannot be flattened here: the run will say so.
      return
  (clean_leaves, clean_structure), (corrupted_leaves, corrupted_structure) = flat
  if clean_structure != corrupted_structure:
    shown = [show_arguments(signature((a.args, a.kwargs))) for a in (clean, corrupted)]
    raise ArgumentError(
      f"{where}: the clean and the corrupted run's arguments differ in structure: the clean"
      f" run's are {shown[0]}, the corrupted run's {shown[1]}. {why} {fix}"
    )
  for (path, a), (_, b) in zip(clean_leaves, corrupted_leaves, strict=True):
    shapes = _shape(a), _shape(b)
    if None not in shapes and shapes[0] != shapes[1] and not (broadcast and _fits(*shapes)):
      raise ArgumentError(
        f"{where}: the clean and the corrupted run's arguments differ in shape:"
        f" {_argument_name(path)} is {_show(a)} in the clean run and {_show(b)} in the"
        f" corrupted run. {why} {fix}"
      )


def _fits(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
  try:
    return np.broadcast_shapes(shape, target) == target
  except ValueError:
    return False


def _shape(leaf: Any) -> tuple[int, ...] | None:
  """The shape of an array or a Python number (`()`); None for other values."""
  if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
    return tuple(leaf.shape)
  return () if isinstance(leaf, bool | int | float | complex) else None


def _show(leaf: Any) -> str:
  if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
    return f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"
  return repr(leaf)


def _argument_name(path: tuple[Any, ...]) -> str:
  """`args[0]`, `kwargs['mask']`: where a leaf of `(args, kwargs)` sits."""
  return ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])


def check_callable(value: Any, name: str, where: str) -> None:
  """Refuses a `name=` argument of `where` (`"fl.sweep"`) that is not a function."""
  if not callable(value):
    raise refuse(
      where,
      name,
      value,
      "a function of the model's output",
      "Pass a function returning an array, for example `lambda out: out[0, -1, 3]`.",
    )


def takes_model_arguments(example: str) -> Callable[[F], F]:
  """Decorates a tool whose model arguments come as one value; `example` shows a call.

  A call that does not bind to the tool's signature (a model argument spread over the
  tool's own, or an unknown option) raises `ArgumentError` naming the offending names
  and showing `example`; other errors pass through untouched.
  """

  def decorate(tool: F) -> F:
    signature = inspect.signature(tool)
    options = [
      p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]

    @functools.wraps(tool)
    def checked(*args: Any, **kwargs: Any) -> Any:
      try:
        return tool(*args, **kwargs)
      except TypeError as error:
        try:
          signature.bind(*args, **kwargs)
        except TypeError as binding:
          raise ArgumentError(
            f"fl.{tool.__name__}: {binding}. The model's arguments are one value after"
            " the tree (one argument, a tuple of positional arguments, or"
            " fl.ArgsAndKwargs.capture(*args, **kwargs) for keyword arguments), and"
            f" fl.{tool.__name__}'s own options are keyword-only"
            f" ({', '.join(options)}). For example: {example}."
          ) from error
        raise

    return checked  # type: ignore[return-value]

  return decorate
