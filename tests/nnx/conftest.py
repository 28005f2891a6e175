"""Shared fixtures for the NNX tests: the corpus, conversion and comparison helpers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl

from . import corpus


@pytest.fixture(scope="session")
def cases() -> dict[str, corpus.Case]:
  return corpus.build()


def convert(case: corpus.Case) -> fl.InterceptedNNXModuleMethod:
  return fl.unflaxify(case.model, *case.args, method=case.method, **case.kwargs)


def call(tree, case: corpus.Case, **kwargs):
  args, kwargs = case.fresh_arguments(**kwargs)
  return tree(fl.ArgsAndKwargs.capture(*args, **kwargs))


def assert_trees_equal(actual, expected) -> None:
  """Same structure and bit-identical leaves."""
  leaves_a, def_a = jax.tree_util.tree_flatten(actual)
  leaves_e, def_e = jax.tree_util.tree_flatten(expected)
  assert def_a == def_e, f"structure differs:\n{def_a}\n{def_e}"
  for a, e in zip(leaves_a, leaves_e, strict=True):
    if jax.dtypes.issubdtype(getattr(a, "dtype", None), jax.dtypes.prng_key):
      a, e = jax.random.key_data(a), jax.random.key_data(e)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def tree_state(tree) -> dict[str, object]:
  """All variables of the tree as {label: value}; labels read "Type:path"."""
  return {
    v.label: v.value for v in fl.variables_in(tree) if not isinstance(v.value, fl.Uninitialized)
  }


def model_state(model: nnx.Module) -> dict[str, object]:
  """All variables of an NNX model as {"Type:path": value}, as the tree labels them."""
  return {
    f"{type(v).__name__}:{'/'.join(map(str, path))}": v.get_raw_value()
    for path, v in nnx.to_flat_state(nnx.state(model))
  }
