"""Specification of `fl.variable_jit`: `jax.jit` for arguments holding bound variables."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlens as fl


def test_returns_the_output_of_the_function():
  double = fl.variable_jit(lambda x: x * 2)
  np.testing.assert_array_equal(double(jnp.arange(3)), [0, 2, 4])


def test_reads_parameter_values(affine):
  out = fl.variable_jit(lambda layer, x: layer(x))(affine, jnp.array(3.0))
  np.testing.assert_allclose(out, 7.0)


def test_writes_back_an_assigned_state_variable_across_calls(counter):
  step = fl.variable_jit(lambda layer, x: layer(x))
  step(counter, jnp.array(0.0))
  step(counter, jnp.array(0.0))
  assert int(counter.count.value) == 2


def test_writes_back_an_assigned_parameter():
  w = fl.Parameter(jnp.array(1.0), label="w")

  @fl.variable_jit
  def update(param):
    param.value = param.value * 3

  update(w)
  np.testing.assert_allclose(w.value, 3.0)


def test_keeps_the_callers_variable_objects(chain):
  counter = chain.layers[1]
  original = counter.count
  fl.variable_jit(lambda layer, x: layer(x))(chain, jnp.array(1.0))
  assert counter.count is original
  assert chain.layers[1] is counter


def test_does_not_write_an_unchanged_state_variable():
  untouched_value = jnp.array(5.0)
  untouched = fl.StateVariable(untouched_value, label="untouched")
  touched = fl.StateVariable(jnp.array(0.0), label="touched")

  @fl.variable_jit
  def step(a, b):
    b.value = b.value + a.value

  step(untouched, touched)
  assert untouched.value is untouched_value
  np.testing.assert_allclose(touched.value, 5.0)


def test_a_shared_variable_stays_one_variable_inside():
  shared = fl.StateVariable(jnp.array(0), label="shared")

  @fl.variable_jit
  def bump_both(first, second):
    first.value = first.value + 1
    second.value = second.value + 1
    return first.value

  out = bump_both(shared, shared)
  assert int(out) == 2
  assert int(shared.value) == 2


def test_does_not_retrace_when_only_array_values_change(affine):
  traces = []

  @fl.variable_jit
  def run(layer, x):
    traces.append(None)
    return layer(x)

  run(affine, jnp.array(1.0))
  affine.scale.value = jnp.array(10.0)
  out = run(affine, jnp.array(2.0))
  np.testing.assert_allclose(out, 21.0)
  assert len(traces) == 1


def test_retraces_when_a_python_leaf_changes():
  traces = []

  @fl.variable_jit
  def run(x, *, train):
    traces.append(train)
    return x

  run(jnp.ones(()), train=True)
  run(jnp.ones(()), train=True)
  run(jnp.ones(()), train=False)
  assert traces == [True, False]


def test_python_bools_stay_python_bools_inside():
  @fl.variable_jit
  def run(x, *, train):
    assert type(train) is bool
    if train:
      return x * 2
    return x

  np.testing.assert_allclose(run(jnp.array(3.0), train=True), 6.0)
  np.testing.assert_allclose(run(jnp.array(3.0), train=False), 3.0)


def test_python_leaves_of_different_types_are_distinct_static_values():
  traces = []

  @fl.variable_jit
  def run(x, flag):
    traces.append(type(flag))
    return x

  run(jnp.ones(()), 1)
  run(jnp.ones(()), True)
  assert traces == [int, bool]


def test_an_unhashable_python_leaf_raises_type_error():
  class Unhashable:
    __hash__ = None

  with pytest.raises(TypeError, match="hashable"):
    fl.variable_jit(lambda x, y: x)(jnp.ones(()), Unhashable())


def test_a_tree_with_unbound_slots_raises_variable_error_naming_the_slot(affine):
  unbound, _ = fl.unbind_variables(affine)
  with pytest.raises(fl.VariableError, match="'scale'"):
    fl.variable_jit(lambda layer, x: layer(x))(unbound, jnp.array(1.0))


def test_returning_a_bound_variable_raises_variable_error():
  w = fl.Parameter(jnp.array(1.0), label="w")
  with pytest.raises(fl.VariableError, match="returned a bound variable"):
    fl.variable_jit(lambda param: param)(w)


def test_works_as_a_decorator_factory_with_keyword_arguments(counter):
  @fl.variable_jit()
  def step(layer, x):
    return layer(x)

  np.testing.assert_allclose(step(counter, jnp.array(4.0)), 4.0)
  assert int(counter.count.value) == 1


def test_forwards_keyword_arguments_to_jax_jit():
  run = fl.variable_jit(keep_unused=True)(lambda x, unused: x + 1)
  np.testing.assert_allclose(run(jnp.array(1.0), jnp.array(0.0)), 2.0)
  with pytest.raises(TypeError, match="unexpected_option"):
    fl.variable_jit(unexpected_option=True)(lambda x: x)


def test_keeps_the_wrapped_functions_name():
  def my_step(x):
    return x

  assert fl.variable_jit(my_step).__name__ == "my_step"


def test_accepts_frozen_values_as_ordinary_pytrees():
  value = fl.ParameterValue(value=jnp.array(2.0), label="w")
  out = fl.variable_jit(lambda v, x: v.value * x)(value, jnp.array(3.0))
  np.testing.assert_allclose(out, 6.0)


def test_argument_selection_options_are_refused_with_a_reason():
  with pytest.raises(TypeError, match="static already"):
    fl.variable_jit(lambda x: x, static_argnums=(0,))


def test_a_sublayer_replaced_in_a_list_in_place_is_run_on_the_next_call(chain, affine):
  run = fl.variable_jit(lambda layer, x: layer(x))
  run(chain, jnp.array(1.0))
  chain.layers[0] = type(affine)(
    scale=fl.Parameter(jnp.array(10.0), label="scale"),
    shift=fl.Parameter(jnp.array(0.0), label="shift"),
  )
  np.testing.assert_allclose(run(chain, jnp.array(1.0)), 10.0)


def test_a_variables_label_cannot_be_reassigned(affine):
  with pytest.raises(fl.VariableError, match=r"'shift' cannot change.*fl.relabel_variables"):
    affine.shift.label = "scale"
  assert affine.shift.label == "shift"


def test_a_layer_relabelled_into_a_clash_is_refused_on_the_next_call(affine):
  run = fl.variable_jit(lambda layer, x: layer(x))
  run(affine, jnp.array(1.0))
  clash = dataclasses.replace(affine, shift=fl.Parameter(affine.shift.value, label="scale"))
  with pytest.raises(fl.VariableError, match="share the label 'scale'"):
    run(clash, jnp.array(1.0))


def test_a_rebuilt_layer_of_the_same_structure_reuses_the_compiled_call(affine):
  traces = []

  @fl.variable_jit
  def run(layer, x):
    traces.append(None)
    return layer(x)

  run(affine, jnp.array(1.0))
  rebuilt = type(affine)(
    scale=fl.Parameter(jnp.array(3.0), label="scale"),
    shift=fl.Parameter(jnp.array(0.0), label="shift"),
  )
  np.testing.assert_allclose(run(rebuilt, jnp.array(2.0)), 6.0)
  assert len(traces) == 1


class _Box:
  """A mutable pytree node of the user's own (flaxlens cannot see it change)."""

  def __init__(self, item):
    self.item = item


jax.tree_util.register_pytree_node(_Box, lambda b: ((b.item,), None), lambda _, c: _Box(*c))


class _Holder(fl.Layer):
  box: object

  def __call__(self, argument, /, **side_inputs):
    return argument * self.box.item.value


def test_a_layer_holding_a_mutable_node_of_another_type_sees_its_edits():
  holder = _Holder(_Box(fl.Parameter(jnp.array(2.0), label="w")))
  run = fl.variable_jit(lambda layer, x: layer(x))
  run(holder, jnp.array(1.0))
  holder.box.item = fl.Parameter(jnp.array(5.0), label="w")
  np.testing.assert_allclose(run(holder, jnp.array(1.0)), 5.0)
