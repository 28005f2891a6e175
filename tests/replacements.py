"""Replacement layers the Linen and NNX patching tests share."""

from __future__ import annotations

import flaxlens as fl


class PlusOne(fl.Layer):
  """Wraps a call: runs the original node, then adds one."""

  inner: object

  def __call__(self, argument, /, **side_inputs):
    return self.inner(argument, **side_inputs) + 1.0


class Recorder(fl.Layer):
  """Wraps a call: remembers what it received, then runs the original node."""

  seen: list
  inner: object

  def __call__(self, argument, /, **side_inputs):
    self.seen.append((argument, side_inputs))
    return self.inner(argument, **side_inputs)
