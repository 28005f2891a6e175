"""Shared fixtures for the core tests: a few tiny layers built only from flaxlens.core."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import pytest

import flaxlens as fl


class Affine(fl.Layer):
  """`x * scale + shift`, with both numbers held in parameters."""

  scale: Any
  shift: Any

  def __call__(self, argument, /, **side_inputs):
    return argument * self.scale.value + self.shift.value


class Counter(fl.Layer):
  """Passes its argument through and counts its calls in a state variable."""

  count: Any

  def __call__(self, argument, /, **side_inputs):
    self.count.value = self.count.value + 1
    return argument


class Chain(fl.Layer):
  """Calls its sublayers one after the other."""

  layers: list

  def __call__(self, argument, /, **side_inputs):
    for layer in self.layers:
      argument = layer(argument, **side_inputs)
    return argument


@pytest.fixture
def affine() -> Affine:
  """`x * 2 + 1`, parameters labelled `scale` and `shift`."""
  return Affine(
    scale=fl.Parameter(jnp.array(2.0), label="scale"),
    shift=fl.Parameter(jnp.array(1.0), label="shift"),
  )


@pytest.fixture
def counter() -> Counter:
  """A counter at 0, its state variable labelled `count`."""
  return Counter(count=fl.StateVariable(jnp.array(0), label="count"))


@pytest.fixture
def chain(affine: Affine, counter: Counter) -> Chain:
  """`affine` then `counter`."""
  return Chain(layers=[affine, counter])
