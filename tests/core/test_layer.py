"""Specification of `fl.Layer`: callable structs, binding and stateless calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlens as fl


class AddOne(fl.Layer):
  def __call__(self, argument, /, **side_inputs):
    return argument + 1


class Scale(fl.Layer):
  factor: float = fl.static_field(default=2.0)

  def __call__(self, argument, /, *, train: bool = False):
    return argument * self.factor if train else argument


def test_a_layer_subclass_is_called_on_one_argument():
  assert AddOne()(41) == 42


def test_a_layer_receives_side_inputs_as_keywords():
  assert Scale()(3.0, train=True) == 6.0
  assert Scale()(3.0, train=False) == 3.0


def test_a_layer_without_call_cannot_be_instantiated():
  class NoCall(fl.Layer):
    pass

  with pytest.raises(TypeError, match="abstract"):
    NoCall()


def test_a_layer_is_a_pytree_of_its_fields(affine):
  leaves = jax.tree_util.tree_leaves(affine)
  assert leaves == [affine.scale, affine.shift]


def test_a_layer_calls_its_bound_variables(chain):
  np.testing.assert_allclose(chain(jnp.array(3.0)), 7.0)
  assert int(chain.layers[1].count.value) == 1


def test_treescope_color_of_a_layer_is_derived_from_its_class_name(affine, counter):
  assert affine.treescope_color() == type(affine)(1, 2).treescope_color()
  assert affine.treescope_color() != counter.treescope_color()


def test_bind_variables_method_fills_the_layers_slots(affine):
  unbound, values = fl.unbind_variables(affine, freeze=True)
  rebound = unbound.bind_variables(values)
  assert type(rebound) is type(affine)
  assert type(rebound.scale) is fl.Parameter
  np.testing.assert_allclose(rebound(jnp.array(3.0)), 7.0)


def test_bind_variables_method_rejects_unknown_labels_unless_allowed(affine):
  unbound, values = fl.unbind_variables(affine, freeze=True)
  extra = (*values, fl.ParameterValue(value=0.0, label="unknown"))
  with pytest.raises(fl.VariableError, match="unknown"):
    unbound.bind_variables(extra)
  assert type(unbound.bind_variables(extra, allow_unused=True).shift) is fl.Parameter


def test_stateless_call_returns_the_output_and_the_new_state_values(chain):
  unbound, values = fl.unbind_variables(chain, freeze=True)
  output, new_state = unbound.stateless_call(values, jnp.array(3.0))
  np.testing.assert_allclose(output, 7.0)
  assert len(new_state) == 1
  assert type(new_state[0]) is fl.StateVariableValue
  assert new_state[0].label == "count"
  assert int(new_state[0].value) == 1


def test_stateless_call_returns_no_parameter_values(affine):
  unbound, values = fl.unbind_variables(affine, freeze=True)
  _, new_state = unbound.stateless_call(values, jnp.array(1.0))
  assert new_state == ()


def test_stateless_call_on_slots_leaves_the_unbound_variables_untouched(counter):
  unbound, (count,) = fl.unbind_variables(counter)
  output, new_state = unbound.stateless_call([count.freeze()], "x")
  assert output == "x"
  assert int(new_state[0].value) == 1
  assert int(count.value) == 0
  assert type(unbound.count) is fl.StateVariableSlot


def test_stateless_call_copies_variables_still_bound_in_the_layer(counter):
  original = counter.count
  output, new_state = counter.stateless_call([], "x")
  assert output == "x"
  assert int(new_state[0].value) == 1
  assert counter.count is original
  assert int(original.value) == 0


def test_stateless_call_given_values_override_bound_variables(counter):
  _, new_state = counter.stateless_call([fl.StateVariableValue(value=10, label="count")], "x")
  assert new_state[0].value == 11
  assert int(counter.count.value) == 0


def test_stateless_call_can_be_repeated_from_the_returned_state(counter):
  unbound, values = fl.unbind_variables(counter, freeze=True)
  _, state = unbound.stateless_call(values, "x")
  _, state = unbound.stateless_call(state, "x")
  assert int(state[0].value) == 2


def test_stateless_call_with_a_missing_slot_value_raises_variable_error_naming_it(affine):
  unbound, values = fl.unbind_variables(affine, freeze=True)
  only_scale = [v for v in values if v.label == "scale"]
  with pytest.raises(fl.VariableError, match="'shift'"):
    unbound.stateless_call(only_scale, jnp.array(1.0))


def test_stateless_call_passes_side_inputs():
  output, _ = Scale(factor=3.0).stateless_call([], 2.0, train=True)
  assert output == 6.0


def test_stateless_call_works_under_jax_jit(chain):
  unbound, values = fl.unbind_variables(chain, freeze=True)
  output, new_state = jax.jit(unbound.stateless_call)(values, jnp.array(3.0))
  np.testing.assert_allclose(output, 7.0)
  assert int(new_state[0].value) == 1
