"""One iteration of a scanned call as a site: `"layers[2]"` (as `fl.sweep` names its rows).

An intervention at `"layers[2]"` edits the scanned call at iteration 2 only: it must
equal, bit for bit, a native model that applies the same edit inside its own scan body
where the iteration number (passed in as the scanned input) is 2; the computation is the
same (`jnp.where` over the iteration), so the results are identical, eagerly and under
jit; for `nn.scan`, `nnx.scan` and a `jax.lax.scan` over the merge of each layer's slice of
stacked weights (MaxText's layout), and `"layers/inner[i,j]"` in nested scans. A capture
of `"layers[2]"` is the stacked capture's slice. A site that runs in no
scan, an iteration out of range, and placing such an intervention are refused.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx

import flaxlens as fl
from flaxlens.errors import ArgumentError, SelectionError

X = jax.random.normal(jax.random.key(0), (2, 4))
LAYERS = 3
STEER = jnp.linspace(-1.0, 1.0, 4)
PART = {
  "linen": 0,
  "nnx": None,
  "jax.lax.scan": None,
}  # the part edited: a Linen scan body returns (y, None)


def _native_edit(kind: str):
  """The edit a native model applies inside its scan body at the chosen iteration."""
  return {"zero": jnp.zeros_like, "steer": lambda y: y + 2.0 * STEER}[kind]


class LinenBlock(nn.Module):
  edit: object = None
  at: int = 2

  @nn.compact
  def __call__(self, x, i):
    y = jnp.tanh(nn.Dense(4)(x)) + x
    if self.edit is not None:  # the native edit: at one iteration of the scan
      y = jnp.where(i == self.at, self.edit(y), y)
    return y, None


class LinenStack(nn.Module):
  edit: object = None
  at: int = 2

  @nn.compact
  def __call__(self, x):
    scanned = nn.scan(
      LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
    )
    x, _ = scanned(self.edit, self.at, name="layers")(x, jnp.arange(LAYERS))
    return nn.Dense(2)(x)


class NNXBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x)) + x


class NNXStack(nnx.Module):
  """Scans its stacked layers with `nnx.scan`, or (`lax`) with `jax.lax.scan` over the
  merge of each layer's slice of the weights, as MaxText's NNX decoder does."""

  def __init__(self, rngs: nnx.Rngs, edit=None, at: int = 2, lax: bool = False):
    self.edit, self.at, self.lax = edit, at, lax

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return NNXBlock(rngs)

    self.layers = blocks(rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    def body(block, i, x):
      y = block(x)
      if self.edit is not None:  # the native edit: at one iteration of the scan
        y = jnp.where(i == self.at, self.edit(y), y)
      return y

    if self.lax:
      graphdef, params, rest = nnx.split(self.layers, nnx.Param, ...)
      merged = lambda x, sliced: (body(nnx.merge(graphdef, *sliced[0]), sliced[1], x), None)
      return self.out(jax.lax.scan(merged, x, ((params, rest), jnp.arange(LAYERS)))[0])
    scan = nnx.scan(body, in_axes=(0, 0, nnx.Carry), out_axes=nnx.Carry)
    return self.out(scan(self.layers, jnp.arange(LAYERS), x))


def _tree_and_native(framework: str, kind: str | None, at: int = 2):
  """The converted plain model and a native function `(x, jit)` with the edit at `at`."""
  edit = None if kind is None else _native_edit(kind)
  if framework == "linen":
    variables = LinenStack().init(jax.random.key(1), X)
    tree = fl.unflaxify(LinenStack(), variables, X)
    native = LinenStack(edit, at).apply
    return tree, lambda x, jit=False: (jax.jit(native) if jit else native)(variables, x)
  lax = framework == "jax.lax.scan"
  tree = fl.unflaxify(NNXStack(nnx.Rngs(1), lax=lax), X)
  native = NNXStack(nnx.Rngs(1), edit, at, lax)
  return tree, lambda x, jit=False: (nnx.jit(NNXStack.__call__) if jit else NNXStack.__call__)(
    native, x
  )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("framework", ["linen", "nnx", "jax.lax.scan"])
def test_an_intervention_at_one_iteration_equals_the_native_edit_there(framework, jit):
  part = PART[framework]
  for kind, intervention, at in [
    ("zero", fl.ablate("layers[2]", part=part), 2),
    ("steer", fl.steer("layers[1]", STEER, alpha=2.0, part=part), 1),
  ]:
    tree, native = _tree_and_native(framework, kind, at)
    out = fl.run(tree, X, interventions=[intervention], jit=jit)
    assert_trees_equal(out, native(X, jit))


@pytest.mark.parametrize("framework", ["linen", "nnx", "jax.lax.scan"])
def test_a_capture_of_one_iteration_is_the_stacked_capture_s_slice(framework):
  tree, _ = _tree_and_native(framework, None)
  _, stacked = fl.capture(tree, X, "layers", inputs=True)
  _, one = fl.capture(tree, X, "layers[2]", inputs=True)
  assert sorted(one) == ["layers[2]", "layers[2]:input"]
  assert_trees_equal(one["layers[2]"], _at(stacked["layers"], 2))
  assert_trees_equal(one["layers[2]:input"], _at(stacked["layers:input"], 2))
  _, both = fl.capture(tree, X, ["layers", "layers[0]"], jit=False)
  assert sorted(both) == ["layers", "layers[0]"]
  assert_trees_equal(both["layers[0]"], _at(stacked["layers"], 0))


def _at(stacked, iteration: int):
  """Iteration `iteration` of a stacked capture (Linen's scan body returns (y, None))."""
  return jax.tree_util.tree_map(lambda x: x[iteration], stacked)


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_an_iteration_the_scan_does_not_run_or_a_call_in_no_scan_is_refused(framework):
  tree, _ = _tree_and_native(framework, None)
  part = PART[framework]
  with pytest.raises(SelectionError, match=r"layers\[3\].*\[3\] iteration.*from 0 to 2"):
    fl.run(tree, X, interventions=[fl.ablate("layers[3]", part=part)])
  with pytest.raises(SelectionError, match=r"layers\[5\].*from 0 to 2"):
    fl.capture(tree, X, "layers[5]")
  with pytest.raises(SelectionError, match=r"\[0\]: this call runs in no scan.*without the suffix"):
    out = "Dense_0" if framework == "linen" else "out"
    fl.run(tree, X, interventions=[fl.ablate(f"{out}[0]")])
  with pytest.raises(SelectionError, match=r"layers\[0,1\].*1 scan.*one number per"):
    fl.run(tree, X, interventions=[fl.ablate("layers[0,1]", part=part)])
  with pytest.raises(ArgumentError, match=r"one iteration of layers.*fl.run"):
    fl.place(tree, fl.ablate("layers[2]", part=part))
  with pytest.raises(SelectionError, match=r"takes whole calls.*Give 'layers'"):
    fl.sweep(tree, X, X, "layers[2]", lambda out: out.sum())


class LinenInner(nn.Module):
  edit: object = None
  at: tuple = (1, 0)

  @nn.compact
  def __call__(self, x, ij):
    y = jnp.tanh(nn.Dense(4)(x)) + x
    if self.edit is not None:  # the native edit: at one iteration of both scans
      y = jnp.where((ij[0] == self.at[0]) & (ij[1] == self.at[1]), self.edit(y), y)
    return y, None


class LinenOuter(nn.Module):
  edit: object = None
  at: tuple = (1, 0)

  @nn.compact
  def __call__(self, x, i):
    inner = nn.scan(LinenInner, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
    x, _ = inner(self.edit, self.at, name="inner")(x, (jnp.full(2, i), jnp.arange(2)))
    return x, None


class LinenNested(nn.Module):
  edit: object = None
  at: tuple = (1, 0)

  @nn.compact
  def __call__(self, x):
    outer = nn.scan(LinenOuter, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
    x, _ = outer(self.edit, self.at, name="layers")(x, jnp.arange(3))
    return nn.Dense(2)(x)


def test_nested_scans_take_one_iteration_number_each_outer_first():
  variables = LinenNested().init(jax.random.key(1), X)
  tree = fl.unflaxify(LinenNested(), variables, X)
  out = fl.run(tree, X, interventions=[fl.ablate("layers/inner[1,0]", part=0)])
  assert_trees_equal(out, jax.jit(LinenNested(jnp.zeros_like, (1, 0)).apply)(variables, X))
  _, stacked = fl.capture(tree, X, "layers/inner")
  _, one = fl.capture(tree, X, "layers/inner[2,1]")
  assert_trees_equal(one["layers/inner[2,1]"], _at(_at(stacked["layers/inner"], 2), 1))
  with pytest.raises(SelectionError, match=r"inner\[1\].*2 scan\(s\) of lengths \[3, 2\]"):
    fl.capture(tree, X, "layers/inner[1]")
