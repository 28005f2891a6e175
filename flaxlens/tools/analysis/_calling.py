"""How the tools take a model's arguments: one value after the tree, their options after it.

`fl.run`, `fl.capture`, `fl.sweep`, `fl.attribute`, `fl.grad_at`, `fl.fold` and
`fl.check_equivalence` take the arguments of the model's call as one positional value:
one argument as itself, several positional arguments as a tuple, keyword arguments in an
`fl.ArgsAndKwargs`. Their own options are keyword-only. So no option name (`inputs=`,
`at=`, `jit=`, ...) can ever be taken for an argument of the model, and a model whose
call takes `inputs=` or `method=` runs like any other. `takes_model_arguments` turns a
call written the old way (the model's arguments spread over the tool's) into an
`ArgumentError` that shows the new one; it costs nothing when the call binds.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._checks import refuse
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
