"""Treescope renders converted trees and flaxlens types, user subclasses included."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import treescope
from linen import corpus as linen_corpus
from nnx import corpus as nnx_corpus

import flaxlens as fl


def _linen_tree():
  model = linen_corpus.Transformer()
  tokens = linen_corpus.TOKENS
  return fl.unflaxify(model, model.init(jax.random.key(0), tokens), tokens)


def test_a_linen_tree_shows_each_module_as_its_class_and_name():
  text = treescope.render_to_text(_linen_tree())
  assert "module=Transformer(name=None)" in text
  assert "module=MultiHeadDotProductAttention(name='MultiHeadDotProductAttention_0')" in text
  assert "label='params:TransformerBlock_1/Dense_0/kernel'" in text


def test_a_linen_tree_hides_the_conversion_bookkeeping():
  text = treescope.render_to_text(_linen_tree())
  for field in ("converted_module=", "call_specs=", "origin="):
    assert field not in text


def test_an_nnx_tree_shows_its_module_class_and_definition_in_one_line():
  tree = fl.unflaxify(nnx_corpus.Scanned(nnx_corpus.RNGS()), nnx_corpus.X)
  text = treescope.render_to_text(tree)
  assert "module_type=Scanned," in text
  assert "NNXModuleDef(<GraphDef>, 4 variables)" in text
  assert "label='Param:blocks/linear/kernel'" in text
  for field in ("specs=", "origin="):
    assert field not in text


class MyParam(fl.Parameter):
  pass


class MyState(fl.StateVariable):
  pass


class MyParamValue(fl.ParameterValue):
  pass


def test_a_user_subclass_of_a_variable_renders_under_its_own_name():
  text = treescope.render_to_text([MyParam(jnp.ones(2), label="w"), MyState(3, label="n")])
  assert "MyParam(" in text and "label='w'" in text
  assert "MyState(" in text and "value=3" in text


def test_a_user_subclass_of_a_variable_value_renders_under_its_own_name():
  text = treescope.render_to_text(MyParamValue(value=jnp.ones(2), label="w"))
  assert "MyParamValue(" in text and "label='w'" in text


def test_a_user_subclass_of_a_variable_has_the_color_of_its_kind():
  assert MyParam(0).treescope_color() == fl.Parameter(0).treescope_color()
  assert MyState(0).treescope_color() == fl.StateVariable(0).treescope_color()
  assert MyParam(0).treescope_color() != MyState(0).treescope_color()
  html = treescope.render_to_html(MyParam(0, label="w"), compressed=False)
  assert fl.Parameter(0).treescope_color() in html


class Doubler(fl.Layer):
  scale: Any

  def __call__(self, argument, /, **side_inputs):
    return argument * 2 * self.scale


def test_a_user_layer_renders_with_its_fields_and_variables():
  text = treescope.render_to_text(Doubler(MyParam(1.0, label="scale")))
  assert "Doubler(" in text and "scale=MyParam(" in text


class Annotated(fl.Struct):
  kind: Any = fl.static_field()
  note: str = fl.static_field()
  value: Any

  treescope_hidden_fields = ("note",)
  treescope_short_fields = ("kind",)


def test_a_user_struct_declares_its_hidden_and_short_fields():
  text = treescope.render_to_text(Annotated(kind=dict, note="internal", value=[1, 2]))
  assert text.startswith("Annotated(") and "kind=dict," in text and "value=[1, 2]" in text
  assert "note" not in text and "internal" not in text


def test_a_user_struct_with_its_own_treescope_repr_keeps_it():
  class Custom(fl.Struct):
    value: Any

    def __treescope_repr__(self, path, subtree_renderer):
      return treescope.rendering_parts.text("<custom>")

  assert treescope.render_to_text(Custom(1)) == "<custom>"
