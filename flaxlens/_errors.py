"""The exceptions flaxlens raises; each message names the model path and the fix."""

from __future__ import annotations


class FlaxlensError(Exception):
  """Base class of flaxlens errors about a model, a tree or a call."""


class UnsupportedFlaxFeatureError(FlaxlensError, NotImplementedError):
  """The model uses a Flax construct flaxlens cannot convert exactly."""


class CallStructureError(FlaxlensError):
  """A call of a converted tree made other submodule calls than at conversion."""
