"""Shared fixtures for the NNX tests: the corpus, conversion and comparison helpers."""

from __future__ import annotations

import pytest
from comparisons import assert_trees_equal  # noqa: F401 (re-exported to the tests)
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


def tree_state(tree) -> dict[str, object]:
  """All variables of the tree as {label: value}; labels read "Type:path"."""
  return {
    v.label: v.value for v in fl.variables_in(tree) if not isinstance(v.value, fl.Uninitialized)
  }


def _key(key) -> str:
  return str(key).replace("~", "~0").replace("/", "~1")


def model_state(model: nnx.Module) -> dict[str, object]:
  """All variables of an NNX model as {"Type:path": value}, as the tree labels them.

  Path keys are joined by "/"; a "/" inside a key is written "~1", a "~" "~0".
  """
  return {
    f"{type(v).__name__}:{'/'.join(map(_key, path))}": v.get_raw_value()
    for path, v in nnx.to_flat_state(nnx.state(model))
  }
