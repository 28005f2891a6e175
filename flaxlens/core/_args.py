"""ArgsAndKwargs: the positional and keyword arguments of one method call, as a pytree."""

from __future__ import annotations

from typing import Any

from flaxlens.core._struct import Struct
from flaxlens.errors import ArgumentError


class ArgsAndKwargs(Struct):
  """The arguments of one call: a tuple of positional and a dict of keyword arguments.

  Example:
    >>> import flaxlens as fl
    >>> call = fl.ArgsAndKwargs.capture(1, 2, train=True)
    >>> call.args, call.kwargs
    ((1, 2), {'train': True})
  """

  args: tuple[Any, ...]
  kwargs: dict[str, Any]

  def __post_init__(self) -> None:
    # Only direct construction is checked: JAX rebuilds instances (with placeholders
    # for leaves, or prefix trees such as in_axes) through `tree_unflatten`.
    if type(self.args) is not tuple or not isinstance(self.kwargs, dict):
      raise ArgumentError(
        "ArgsAndKwargs(args, kwargs) takes a tuple of positional arguments and a dict of"
        f" keyword arguments, got a {type(self.args).__name__} and a"
        f" {type(self.kwargs).__name__}. To pass arrays as arguments, write"
        " fl.ArgsAndKwargs.capture(*args, **kwargs)."
      )

  @classmethod
  def capture(cls, *args: Any, **kwargs: Any) -> ArgsAndKwargs:
    """Packs `*args, **kwargs` as they would be passed to a call."""
    return cls(args=args, kwargs=kwargs)
