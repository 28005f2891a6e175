"""Captures inside Linen lifted transforms, whatever collections the model declares.

`nn.scan` carries a collection out of its body only if the model declares it
(`variable_axes`); Flax's own `capture_intermediates` is then empty for calls inside an
undeclared body. flaxlens carries captured values out of every scan body itself. The
reference is the same model with `intermediates` declared (same parameters), captured by
Flax; values must be equal bit for bit, stacked along the scan axis (in iteration order,
also for `reverse=True`).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal

import flaxlens as fl


class Cell(nn.Module):
  inner: str = "plain"

  @nn.compact
  def __call__(self, c, x):
    dense = nn.Dense(4)
    if self.inner == "remat":
      dense = nn.remat(nn.Dense)(4)
    elif self.inner == "jit":
      dense = nn.jit(nn.Dense)(4)
    h = dense(c) + x
    return jnp.tanh(h), h


class Net(nn.Module):
  declare: bool
  reverse: bool = False
  inner: str = "plain"

  @nn.compact
  def __call__(self, xs):
    axes = {"params": 0, "intermediates": 0} if self.declare else {"params": 0}
    scan = nn.scan(
      Cell,
      variable_axes=axes,
      split_rngs={"params": True},
      in_axes=1,
      out_axes=1,
      reverse=self.reverse,
    )
    c, ys = scan(inner=self.inner, name="cells")(xs[:, 0], xs)
    return nn.Dense(3)(c) + ys.sum()


XS = jax.random.normal(jax.random.key(0), (2, 5, 4))


def _flax_capture(reverse, inner, jit):
  model = Net(declare=True, reverse=reverse, inner=inner)
  variables = model.init(jax.random.key(1), XS)

  def apply(v, xs):
    return model.apply(v, xs, capture_intermediates=True, mutable=["intermediates"])

  out, state = (jax.jit(apply) if jit else apply)(variables, XS)
  return variables, out, state["intermediates"]


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("inner", ["plain", "remat", "jit"])
def test_calls_in_an_undeclared_scan_body_come_out_stacked(reverse, inner):
  jit = inner == "jit"  # Captures inline nn.jit bodies: compare compiled with compiled.
  variables, native_out, native = _flax_capture(reverse, inner, jit)
  model = Net(declare=False, reverse=reverse, inner=inner)
  tree = fl.unflaxify(model, variables, XS)
  out, cache = fl.capture(tree, XS, jit=jit)
  assert_trees_equal(out, native_out)
  dense = {"plain": "Dense_0", "remat": "CheckpointDense_0", "jit": "JitDense_0"}[inner]
  assert cache[f"cells/{dense}"].shape == (5, 2, 4)
  assert_trees_equal(cache[f"cells/{dense}"], native["cells"][dense]["__call__"][0])
  assert_trees_equal(cache["cells"], native["cells"]["__call__"][0])


def test_a_capture_under_vmap_equals_each_example_captured_alone():
  model = Net(declare=False)
  variables = model.init(jax.random.key(1), XS)
  tree = fl.unflaxify(model, variables, XS)
  batch = jnp.stack([XS, 2 * XS])
  _, cache = jax.vmap(lambda xs: fl.capture(tree, xs, at="cells/Dense_0", jit=False))(batch)
  for i in range(2):
    _, alone = fl.capture(tree, batch[i], at="cells/Dense_0", jit=False)
    assert_trees_equal(cache["cells/Dense_0"][i], alone["cells/Dense_0"])


def test_gradients_flow_through_captured_values():
  model = Net(declare=True)
  variables = model.init(jax.random.key(1), XS)
  tree = fl.unflaxify(model, variables, XS)

  def ours(xs):
    return fl.capture(tree, xs, at="cells/Dense_0", jit=False)[1]["cells/Dense_0"].sum()

  def native(xs):
    _, state = model.apply(variables, xs, capture_intermediates=True, mutable=["intermediates"])
    return state["intermediates"]["cells"]["Dense_0"]["__call__"][0].sum()

  assert_trees_equal(jax.grad(ours)(XS), jax.grad(native)(XS))


# --- a method decorated with a lifted transform -----------------------------------------
# As Flax's `examples/sst2` classifier: an LSTM whose `__call__` is decorated with
# `nn.transforms.scan` (Flax traces the body twice: once for shapes, once in the loop),
# and a method `initialize_carry` called first. The model is initialized as written;
# the reference applies the same class with `intermediates` declared.


def _lstm_class(intermediates: dict) -> type:
  class SimpleLSTM(nn.Module):
    hidden_size: int

    @functools.partial(
      nn.transforms.scan,
      variable_broadcast="params",
      variable_axes=intermediates,
      in_axes=1,
      out_axes=1,
      split_rngs={"params": False},
    )
    @nn.compact
    def __call__(self, carry, x):
      return nn.OptimizedLSTMCell(self.hidden_size)(carry, x)

    def initialize_carry(self, input_shape):
      cell = nn.OptimizedLSTMCell(self.hidden_size, parent=None)
      return cell.initialize_carry(jax.random.key(0), input_shape)

  return SimpleLSTM


LSTMS = {False: _lstm_class({}), True: _lstm_class({"intermediates": 0})}


class BiLSTM(nn.Module):
  declare: bool

  def setup(self):
    self.forward_lstm = LSTMS[self.declare](3)
    self.backward_lstm = LSTMS[self.declare](3)

  def __call__(self, inputs):
    carry = self.forward_lstm.initialize_carry(inputs[:, 0].shape)
    _, forward = self.forward_lstm(carry, inputs)
    carry = self.backward_lstm.initialize_carry(inputs[:, 0].shape)
    _, backward = self.backward_lstm(carry, jnp.flip(inputs, 1))
    return jnp.concatenate([forward, jnp.flip(backward, 1)], -1)


class ScannedFunction(nn.Module):
  """`nn.scan` of a function taking the module, which calls two submodules."""

  declare: bool

  def setup(self):
    self.a = nn.Dense(4)
    self.b = nn.Dense(4)

  def __call__(self, xs):
    def body(module, carry, x):
      h = jnp.tanh(module.b(module.a(carry)) + x)
      return h, h

    scan = nn.scan(
      body,
      variable_broadcast="params",
      variable_axes={"intermediates": 0} if self.declare else {},
      split_rngs={"params": False},
      in_axes=1,
      out_axes=1,
    )
    return scan(self, xs[:, 0], xs)[0]


def _flax_names(intermediates: dict, root: str) -> dict[str, object]:
  """Flax's captured `__call__` outputs, by the site names flaxlens gives the calls."""
  found = {}

  def walk(path, tree):
    for name, child in tree.items():
      if name == "__call__":
        found["/".join(path) or root] = child[0]
      else:
        walk((*path, name), child)

  walk((), intermediates)
  return found


@pytest.mark.parametrize("model", [BiLSTM, ScannedFunction], ids=["decorated", "function"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_calls_in_a_body_flax_scans_for_a_method_or_function_are_one_site_each(model, jit):
  xs = jax.random.normal(jax.random.key(0), (2, 5, 4))
  variables = model(declare=False).init(jax.random.key(1), xs)
  tree = fl.unflaxify(model(declare=False), variables, xs)
  out, cache = fl.capture(tree, xs, jit=jit)

  def apply(v, x):
    return model(declare=True).apply(v, x, capture_intermediates=True, mutable=["intermediates"])

  native_out, state = (jax.jit(apply) if jit else apply)(variables, xs)
  native = _flax_names(state["intermediates"], f"{model.__name__}.__call__")
  assert_trees_equal(out, native_out)
  # Flax's capture records `__call__` only: other methods are captured by flaxlens alone.
  assert sorted(n for n in cache if "." not in n or n in native) == sorted(native)
  for name, value in native.items():
    assert_trees_equal(cache[name], value)
