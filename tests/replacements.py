"""Replacement layers the tests patch into trees, and their native counterparts.

`plus_one` and `zeros` are what `PlusOne` and `Zeros` do to a call's output, written as
`frameworks.Wrap` functions to patch the same call of the native model.
"""

from __future__ import annotations

import jax.numpy as jnp

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


class Zeros(fl.Layer):
  """Replacement returning zeros with `features` in the last axis of its input's shape."""

  features: int = fl.static_field()

  def __call__(self, argument, /, **side_inputs):
    x = argument.args[0]
    return jnp.zeros(x.shape[:-1] + (self.features,), x.dtype)


class Identity(fl.Layer):
  """Wraps a call: runs the original node and returns what it returns."""

  inner: object

  def __call__(self, argument, /, **side_inputs):
    return self.inner(argument, **side_inputs)


def plus_one(output, *args):
  """The native counterpart of `PlusOne`."""
  return output + 1.0


def zeros(output, *args):
  """The native counterpart of `Zeros`."""
  return jnp.zeros_like(output)
