"""Specification of `fl.RandomStream`: a base key plus a counter in a StateVariable."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import flaxlens as fl


def key_bits(key):
  return np.asarray(jax.random.key_data(key))


def test_from_base_key_starts_the_counter_at_zero():
  stream = fl.RandomStream.from_base_key(jax.random.key(0))
  assert type(stream.offset) is fl.StateVariable
  assert int(stream.offset.value) == 0


def test_from_base_key_uses_the_given_label():
  stream = fl.RandomStream.from_base_key(jax.random.key(0), label="dropout_rng")
  assert stream.offset.label == "dropout_rng"


def test_next_key_differs_across_calls():
  stream = fl.RandomStream.from_base_key(jax.random.key(0))
  first, second = key_bits(stream.next_key()), key_bits(stream.next_key())
  assert not np.array_equal(first, second)


def test_next_key_is_deterministic_from_the_base_key():
  one = fl.RandomStream.from_base_key(jax.random.key(7))
  other = fl.RandomStream.from_base_key(jax.random.key(7))
  for _ in range(3):
    np.testing.assert_array_equal(key_bits(one.next_key()), key_bits(other.next_key()))


def test_streams_from_different_base_keys_give_different_keys():
  one = fl.RandomStream.from_base_key(jax.random.key(0))
  other = fl.RandomStream.from_base_key(jax.random.key(1))
  assert not np.array_equal(key_bits(one.next_key()), key_bits(other.next_key()))


def test_next_key_advances_the_counter_eagerly():
  stream = fl.RandomStream.from_base_key(jax.random.key(0))
  stream.next_key()
  stream.next_key()
  assert int(stream.offset.value) == 2


def test_next_key_under_variable_jit_advances_the_counter_across_calls():
  stream = fl.RandomStream.from_base_key(jax.random.key(0))
  draw = fl.variable_jit(lambda s: s.next_key())
  first, second = key_bits(draw(stream)), key_bits(draw(stream))
  assert not np.array_equal(first, second)
  assert int(stream.offset.value) == 2


def test_next_key_under_variable_jit_gives_the_same_keys_as_eagerly():
  jitted_stream = fl.RandomStream.from_base_key(jax.random.key(3))
  eager_stream = fl.RandomStream.from_base_key(jax.random.key(3))
  draw = fl.variable_jit(lambda s: s.next_key())
  for _ in range(2):
    np.testing.assert_array_equal(key_bits(draw(jitted_stream)), key_bits(eager_stream.next_key()))


def test_next_key_twice_in_one_jitted_call_gives_two_keys():
  stream = fl.RandomStream.from_base_key(jax.random.key(0))
  first, second = fl.variable_jit(lambda s: (s.next_key(), s.next_key()))(stream)
  assert not np.array_equal(key_bits(first), key_bits(second))
  assert int(stream.offset.value) == 2


def test_next_key_on_a_frozen_offset_raises_type_error():
  frozen = fl.freeze_variables(fl.RandomStream.from_base_key(jax.random.key(0)))
  with pytest.raises(TypeError, match="StateVariableValue"):
    frozen.next_key()


def test_next_key_on_an_unbound_offset_raises_type_error():
  unbound, _ = fl.unbind_variables(fl.RandomStream.from_base_key(jax.random.key(0)))
  with pytest.raises(TypeError, match="Bind its variables"):
    unbound.next_key()


def test_the_base_key_is_a_leaf_and_the_offset_a_variable():
  stream = fl.RandomStream.from_base_key(jax.random.key(0))
  leaves = jax.tree_util.tree_leaves(stream)
  assert leaves[0] is stream.base_key
  assert leaves[1] is stream.offset
