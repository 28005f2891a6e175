"""How the tests compare flaxlens results with native Flax: structure and bits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np


def assert_trees_equal(actual, expected) -> None:
  """Same pytree structure and bit-identical leaves (JAX keys compared by key data)."""
  leaves_a, def_a = jax.tree_util.tree_flatten(actual)
  leaves_e, def_e = jax.tree_util.tree_flatten(expected)
  assert def_a == def_e, f"structure differs:\n{def_a}\n{def_e}"
  for a, e in zip(leaves_a, leaves_e, strict=True):
    if jax.dtypes.issubdtype(getattr(a, "dtype", None), jax.dtypes.prng_key):
      a, e = jax.random.key_data(a), jax.random.key_data(e)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


# jax's event for an XLA compilation (jax/_src/dispatch.py, BACKEND_COMPILE_EVENT).
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
  """The XLA compilations that happen inside the block, one event each."""
  events: list[str] = []

  def listen(event, duration, **kwargs):
    if event == BACKEND_COMPILE:
      events.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
