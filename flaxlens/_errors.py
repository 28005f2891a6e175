"""The exceptions flaxlens raises; each message names the model path and the fix.

Every error about a model, a tree, a selection or a call subclasses `FlaxlensError`, so
one `except fl.FlaxlensError` catches them all; where an error used to be (or also is)
a built-in error, it subclasses that too.
"""

from __future__ import annotations


class FlaxlensError(Exception):
  """Base class of flaxlens errors about a model, a tree or a call."""


class UnsupportedFlaxFeatureError(FlaxlensError, NotImplementedError):
  """The model uses a Flax construct flaxlens cannot convert exactly."""


class CallStructureError(FlaxlensError):
  """A call of a converted tree made other submodule calls than at conversion."""


class ReplacementError(FlaxlensError):
  """A replacement in a tree is not a layer, or returned what its call cannot return."""


class ArgumentError(FlaxlensError, TypeError):
  """A tree or a call was given arguments of the wrong kind."""


class VariableError(FlaxlensError, ValueError):
  """A variable, slot or label was used inconsistently, or would hold a leaked tracer."""


class SelectionError(FlaxlensError, KeyError, ValueError):
  """A selection found other nodes than asked for, or cannot make the edit asked for."""

  def __str__(self) -> str:
    return str(self.args[0]) if self.args else ""
