"""Patching what only Linen has: `capture_intermediates`, automatic names, module settings.

Patching behaviours both frameworks share are in tests/shared/test_patching.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, Wrap, flat_collections
from replacements import PlusOne, Zeros, plus_one

import flaxlens as fl


def test_capture_intermediates_leaves_out_a_call_whose_replacement_skips_it(cases):
  case = cases["capture_intermediates"]
  patched = LINEN.convert(case).select().at_path("Dense_0").apply(lambda _: Zeros(16))

  def zeros_instead(next_fun, args, kwargs, context):
    if context.module.name == "Dense_0" and context.method_name == "__call__":
      return jnp.zeros((2, 16))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(zeros_instead):
    expected_out, expected_state = case.apply()
  del expected_state["intermediates"]["Dense_0"]
  assert_trees_equal(LINEN.call(patched, case), expected_out)
  assert_trees_equal(LINEN.tree_state(patched), flat_collections(expected_state))


def test_capture_intermediates_captures_what_a_wrapper_returns(cases):
  case = cases["capture_intermediates"]
  expected_out, expected_state = LINEN.native(case, wrap=Wrap("Dense_0", plus_one))
  wrapped = LINEN.convert(case).select().at_path("Dense_0").apply(PlusOne)
  assert_trees_equal(LINEN.call(wrapped, case), expected_out)
  assert_trees_equal(LINEN.tree_state(wrapped), expected_state)


def test_module_names_are_stable_keys(cases):
  assert list(LINEN.convert(cases["transformer"]).submodule_calls) == [
    (0, "Embed_0.__call__"),
    (1, "TransformerBlock_0.__call__"),
    (2, "TransformerBlock_1.__call__"),
    (3, "LayerNorm_0.__call__"),
    (4, "Dense_0.__call__"),
  ]


class Configured(nn.Module):
  """Two Dense layers; the first one's dtype is a setting of the model."""

  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(8, dtype=self.dtype, name="first")(x))
    return nn.Dense(4, name="second")(h)


def _edit_module(tree, path, **settings):
  def edit(node):
    return dataclasses.replace(node, module=node.module.clone(**settings))

  return tree.select().at_path(path).apply(edit)


def test_an_edited_module_setting_takes_effect_in_the_whole_tree():
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = Configured().init(jax.random.key(0), x)
  tree = _edit_module(fl.unflaxify(Configured(), variables, x), "first", dtype=jnp.bfloat16)
  expected = Configured(dtype=jnp.bfloat16).apply(variables, x)
  assert_trees_equal(tree(fl.ArgsAndKwargs.capture(x)), expected)


def test_export_refuses_a_tree_whose_submodule_settings_were_edited():
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = Configured().init(jax.random.key(0), x)
  tree = _edit_module(fl.unflaxify(Configured(), variables, x), "first", dtype=jnp.bfloat16)
  with pytest.raises(fl.ExportError, match=r"\['first\.__call__'\] were edited"):
    tree.export()


def test_an_edit_that_changes_the_modules_variables_is_refused():
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = Configured().init(jax.random.key(0), x)
  tree = _edit_module(fl.unflaxify(Configured(), variables, x), "first", features=5)
  with pytest.raises(fl.FlaxlensError, match=r"^first\.__call__: the edited settings \['features"):
    tree(fl.ArgsAndKwargs.capture(x))


class ScaledDense(nn.Module):
  scale: float = 1.0

  def setup(self):
    self.dense = nn.Dense(4)

  def __call__(self, x):
    return self.dense(x) * self.scale


class WithSetupChild(nn.Module):
  @nn.compact
  def __call__(self, x):
    return ScaledDense(name="scaled")(x)


def test_an_edit_of_a_module_with_setup_is_refused():
  x = jax.random.normal(jax.random.key(1), (2, 3))
  variables = WithSetupChild().init(jax.random.key(0), x)
  tree = _edit_module(fl.unflaxify(WithSetupChild(), variables, x), "scaled", scale=2.0)
  with pytest.raises(fl.FlaxlensError, match=r"^scaled\.__call__: .*setup"):
    tree(fl.ArgsAndKwargs.capture(x))
