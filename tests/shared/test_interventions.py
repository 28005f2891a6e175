"""Interventions: `fl.run` edits exactly the targeted calls, as a native edit of the model.

For each corpus model, the first module called with `__call__` whose output is one
floating array is scaled or steered through `fl.run`; the native reference wraps the
same module's calls (Linen `nn.intercept_methods`, NNX a subclass of its class). Output
and updated state must be equal bit for bit.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from frameworks import FRAMEWORKS, Wrap

import flaxlens as fl
from flaxlens.tools.base._sites import sites_of

CASES = [(fw, name) for fw in FRAMEWORKS.values() for name in fw.corpus.NAMES]
# The native reference wraps a module's class in a subclass; nnx.capture inside this
# model then wraps both classes' `__call__` and records the call twice.
_SUBCLASS_SEEN_TWICE = {"capture_sow_perturb"}


def _target(tree):
  """The module path of the first call of `__call__` returning one floating array."""
  for site in sites_of(tree)[1:]:
    if site.node.method_name != "__call__" or site.output is None:
      continue
    treedef, leaves = site.output
    array = isinstance(leaves[0], jax.ShapeDtypeStruct) if leaves else False
    if site.node.path and jax.tree_util.treedef_is_leaf(treedef) and array:
      if jnp.issubdtype(leaves[0].dtype, jnp.floating) and leaves[0].shape:
        return "/".join(map(str, site.node.path)), leaves[0]
  return None, None


def _assert_same(fw, tree, ours, native):
  out, state = native
  assert_trees_equal(ours, out)
  mine = fw.tree_state(tree)
  assert_trees_equal(
    {k: mine[k] for k in state if k in mine}, {k: state[k] for k in state if k in mine}
  )


@pytest.mark.parametrize(("fw", "name"), CASES)
def test_steering_a_call_equals_the_native_edit(corpora, fw, name):
  if name in _SUBCLASS_SEEN_TWICE:
    pytest.skip("the native reference records the edited call twice")
  case = corpora[fw][name]
  tree = fw.convert(case)
  path, spec = _target(tree)
  if path is None:
    pytest.skip("no call returning one floating array")
  vector = jnp.linspace(-1.0, 1.0, spec.shape[-1]).astype(spec.dtype)
  argument = fw.argument(case)
  ours = fl.run(
    tree,
    argument,
    interventions=[fl.steer(f"{path}.__call__", vector, alpha=0.5)],
    jit=False,
    **fw.side_inputs(case),
  )
  alpha = jnp.asarray(0.5, jnp.float32)
  native = fw.native(
    case, wrap=Wrap(path, lambda out, *a: (out + alpha * vector).astype(out.dtype))
  )
  _assert_same(fw, tree, ours, native)


@pytest.mark.parametrize(("fw", "name"), CASES)
def test_a_position_restricted_scale_equals_the_native_edit(corpora, fw, name):
  if name in _SUBCLASS_SEEN_TWICE or name == "rngs_argument":
    pytest.skip("the native reference cannot run this model under nnx.jit as called")
  case = corpora[fw][name]
  tree = fw.convert(case)
  path, spec = _target(tree)
  if path is None:
    pytest.skip("no call returning one floating array")
  argument = fw.argument(case)
  where = (Ellipsis, 0)
  ours = fl.run(
    tree,
    argument,
    interventions=[fl.scale(f"{path}.__call__", 3.0, where=where)],
    jit=True,
    **fw.side_inputs(case),
  )

  def edit(out, *args):  # the edit written by hand, with the same operations
    mask = jnp.zeros(out.shape, bool).at[where].set(True)
    return jnp.where(mask, out * jnp.asarray(3.0, jnp.float32), out).astype(out.dtype)

  native = fw.native(case, jit=True, wrap=Wrap(path, edit))
  _assert_same(fw, tree, ours, native)


class _TwoLayers(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="out")(nn.relu(nn.Dense(8, name="hidden")(x)))


@pytest.mark.parametrize("batch", [2, 5], ids=["batch-2", "batch-equals-length"])
@pytest.mark.parametrize("where", ["last", "positions"])
def test_a_value_captured_with_an_index_patches_back_at_that_index(batch, where):
  """A patched value or steering vector shaped like the region `where=` selects (as
  `fl.capture(index=)` gives it) goes to that region, example by example, also where the
  batch is as long as the sequence and the value would broadcast to the whole output."""
  index = jnp.s_[:, -1] if where == "last" else jnp.s_[:, jnp.array([0, 2, 4])]
  model, clean = _TwoLayers(), jax.random.normal(jax.random.key(1), (batch, 5, 3))
  variables = model.init(jax.random.key(0), clean)
  tree = fl.unflaxify(model, variables, clean)
  _, cache = fl.capture(tree, clean, at="hidden", index=index)
  vector = jax.random.normal(jax.random.key(2), cache["hidden"].shape)  # per example
  patched = fl.run(tree, -clean, interventions=[fl.patch("hidden", cache["hidden"], where=index)])
  steered = fl.run(tree, clean, interventions=[fl.steer("hidden", vector, 2.0, where=index)])

  _, sown = model.apply(variables, clean, capture_intermediates=True, mutable=["intermediates"])
  clean_hidden = sown["intermediates"]["hidden"]["__call__"][0]

  def native(x, edit):
    def intercept(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      return edit(out) if context.module.name == "hidden" else out

    with nn.intercept_methods(intercept):
      return model.apply(variables, x)

  expected_patch = native(-clean, lambda out: out.at[index].set(clean_hidden[index]))
  expected_steer = native(clean, lambda out: out.at[index].add(2.0 * vector))
  assert_trees_equal(patched, expected_patch)
  assert_trees_equal(steered, expected_steer)


@pytest.mark.parametrize("where", ["last", "positions"])
def test_an_interchange_source_captured_with_an_index_swaps_at_that_index(where):
  """An interchange's source shaped like the region `where=` selects (as `fl.capture(index=)`
  gives it) is the source of that region, as a patch's value is: the native edit rotates
  the base and the source value there, takes the swapped coordinates from the source and
  rotates back, leaving the other positions."""
  index = jnp.s_[:, -1] if where == "last" else jnp.s_[:, jnp.array([0, 2, 4])]
  model, base = _TwoLayers(), jax.random.normal(jax.random.key(1), (2, 5, 3))
  variables = model.init(jax.random.key(0), base)
  tree = fl.unflaxify(model, variables, base)
  source_input = -2.0 * base
  _, cache = fl.capture(tree, source_input, at="hidden", index=index)
  q, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(3), (8, 8)))
  q = q * jnp.where(jnp.diag(jnp.linalg.qr(q)[1]) < 0, -1.0, 1.0)  # signs as R's diagonal > 0
  swapped = jnp.arange(8) < 3
  edit = fl.interchange("hidden", q, cache["hidden"], swapped, where=index)
  ours = fl.run(tree, base, interventions=[edit])

  _, sown = model.apply(
    variables, source_input, capture_intermediates=True, mutable=["intermediates"]
  )
  source = sown["intermediates"]["hidden"]["__call__"][0][index]

  def swap(out):
    rotated = jnp.where(swapped, source @ q.T, out[index] @ q.T)
    return out.at[index].set(rotated @ q)

  def intercept(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return swap(out) if context.module.name == "hidden" else out

  with nn.intercept_methods(intercept):
    expected = model.apply(variables, base)
  assert jnp.allclose(ours, expected, atol=1e-6), float(jnp.abs(ours - expected).max())


def test_an_interchange_source_of_a_region_cutting_the_feature_axis_is_refused():
  # The rotation mixes every feature: a source of some features only cannot be rotated.
  model, base = _TwoLayers(), jnp.ones((2, 5, 3))
  tree = fl.unflaxify(model, model.init(jax.random.key(0), base), base)
  edit = fl.interchange("hidden", jnp.eye(8), jnp.ones((2, 5, 2)), 1, where=jnp.s_[..., 2:4])
  with pytest.raises(fl.ArgumentError, match=r"^hidden: the source has the shape \(2, 5, 2\).*"):
    fl.run(tree, base, interventions=[edit])
