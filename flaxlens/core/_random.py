"""RandomStream: a stateful source of JAX keys (a base key plus a counter).

The counter lives in a `StateVariable`, so a stream advances eagerly and, through
`fl.variable_jit`, under `jax.jit` too. Keys are `fold_in(base_key, counter)`. No Flax
internals here.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from flaxlens.core._struct import Struct
from flaxlens.core._variables import StateVariable
from flaxlens.errors import ArgumentError


class RandomStream(Struct):
  """A stream of random keys: `next_key()` returns a new key on every call.

  Example:
    >>> import flaxlens as fl, jax
    >>> stream = fl.RandomStream.from_base_key(jax.random.key(0))
    >>> bool((jax.random.key_data(stream.next_key())
    ...       != jax.random.key_data(stream.next_key())).any())
    True
  """

  base_key: jax.Array
  offset: Any

  @classmethod
  def from_base_key(cls, base_key: jax.Array, label: str | None = None) -> RandomStream:
    """Starts a stream at counter 0 from `base_key`."""
    return cls(base_key=base_key, offset=StateVariable(jnp.uint32(0), label=label))

  def next_key(self) -> jax.Array:
    """Returns the next key and advances the counter."""
    if not isinstance(self.offset, StateVariable):
      raise ArgumentError(
        "RandomStream.next_key needs a bound StateVariable counter; this stream's"
        f" offset is a {type(self.offset).__name__}. Bind its variables first."
      )
    key = jax.random.fold_in(self.base_key, self.offset.value)
    self.offset.value = self.offset.value + 1
    return key


def detached(stream: RandomStream) -> RandomStream:
  """A copy of `stream` at its counter, advancing on its own (`stream` stays where it is).

  Example:
    >>> import flaxlens as fl, jax
    >>> from flaxlens.core._random import detached
    >>> stream = fl.RandomStream.from_base_key(jax.random.key(0))
    >>> _ = detached(stream).next_key()
    >>> int(stream.offset.value)
    0
  """
  if not isinstance(stream.offset, StateVariable):
    return stream  # next_key refuses it, naming the fix.
  return dataclasses.replace(stream, offset=copy.copy(stream.offset))
