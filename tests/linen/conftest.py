"""Shared fixtures for the Linen tests: the corpus, conversion and comparison helpers."""

from __future__ import annotations

import pytest
from comparisons import assert_trees_equal  # noqa: F401 (re-exported to the tests)

import flaxlens as fl

from . import corpus


@pytest.fixture(scope="session")
def cases() -> dict[str, corpus.Case]:
  return corpus.build()


def convert(case: corpus.Case, **overrides) -> fl.InterceptedFlaxModuleMethod:
  options = dict(
    method=case.method,
    rngs=case.rngs,
    mutable=case.mutable,
    capture_intermediates=case.capture_intermediates,
  )
  options.update(overrides)
  return fl.unflaxify(case.module, case.variables, *case.args, **options, **case.kwargs)


def call(tree, case: corpus.Case, **kwargs):
  return tree(
    fl.ArgsAndKwargs.capture(*case.args, **{**case.kwargs, **kwargs}), random_streams=case.rngs
  )


def tree_state(tree) -> dict[str, object]:
  """The tree's state variables as {label: value}; labels read "collection:path"."""
  return {
    v.label: v.value
    for v in fl.variables_in(tree)
    if isinstance(v, fl.StateVariable) and not isinstance(v.value, fl.Uninitialized)
  }


def _key(name: str) -> str:
  return name.replace("~", "~0").replace("/", "~1")


def flat_collections(collections) -> dict[str, object]:
  """A Flax collections dict as {"collection:path": leaf}, mappings being nodes.

  Paths are written as the tree names variables: keys joined by "/", a "/" inside a
  key (`nn.WeightNorm`'s "Dense_0/kernel/scale") written "~1", a "~" written "~0".
  """
  flat = {}

  def walk(collection, path, value):
    if hasattr(value, "items"):
      for name, child in value.items():
        walk(collection, path + (name,), child)
    else:
      flat[f"{collection}:{'/'.join(map(_key, path))}"] = value

  for collection, tree in collections.items():
    walk(collection, (), tree)
  return flat
