"""ArgsAndKwargs: the positional and keyword arguments of one method call, as a pytree."""

from __future__ import annotations

from typing import Any

from flaxlens.core._struct import Struct


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

  @classmethod
  def capture(cls, *args: Any, **kwargs: Any) -> ArgsAndKwargs:
    """Packs `*args, **kwargs` as they would be passed to a call."""
    return cls(args=args, kwargs=kwargs)
