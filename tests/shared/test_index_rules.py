"""Index rules: `where=` and `index=` edit or keep exactly what NumPy selects, or are refused.

JAX drops out-of-range scatter updates and clamps out-of-range reads without a word, so an
index that reaches outside a value, or selects nothing of it, must be refused by name:
the site, the axis and its size, the positions it allows. Accepted indices are compared
with a native run of the model whose value at the site is edited (or read) with NumPy's
own indexing; a property test draws index forms and shapes and holds every one to that.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import compilations
from flax import nnx
from frameworks import LINEN, NNX, Wrap
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import flaxlens as fl

FRAMEWORKS = [LINEN, NNX]
# Per framework: the corpus MLP's first and second layer (the first's output is 2 x W).
MLP = {LINEN: ("Dense_0", "Dense_1"), NNX: ("hidden", "out")}
# Per framework: the corpus model scanning a block, a call inside the body and how many
# iterations the scan makes (each iteration's value is (2, features)).
SCANNED = {LINEN: ("layers/Dense_0", 3), NNX: ("blocks/linear", 4)}


def _mlp(fw, corpora):
  case = corpora[fw]["mlp"]
  first, second = MLP[fw]
  args = fw.argument(case).args
  return case, fw.convert(case), args, first, second


def _width(fw, corpora) -> int:
  case, tree, args, first, _ = _mlp(fw, corpora)
  _, cache = fw.native_captures(case)
  return cache[(first, "__call__")][0].shape[-1]


def _zeroed_at(index):
  """A native edit of a call's output: zero where NumPy's `value[index] = 0` writes."""

  def edit(output, *args):
    selected = np.zeros(output.shape, bool)
    selected[index] = True
    return jnp.where(selected, jnp.zeros((), output.dtype), output)

  return edit


# --- indices that reach outside the value, or select nothing ------------------------------

# Per case: where= for a first layer of width w, and what the refusal says.
OUTSIDE = {
  "past_the_end": (lambda w: jnp.s_[:, w + 2], lambda w: f"position {w + 2} on axis 1"),
  "negative_past_the_start": (lambda w: jnp.s_[:, -100], lambda w: "position -100 on axis 1"),
  "huge": (lambda w: jnp.s_[:, 10**30], lambda w: f"position {10**30} on axis 1"),
  "first_axis": (lambda w: jnp.s_[5], lambda w: "position 5 on axis 0"),
  "array": (lambda w: jnp.s_[:, jnp.array([0, w])], lambda w: f"positions from 0 to {w}"),
  "empty_slice": (lambda w: jnp.s_[..., w : w + 16], lambda w: f"slice {w}:{w + 16} is empty"),
  "too_many_axes": (lambda w: jnp.s_[0, 0, 0], lambda w: "indexes 3 axes"),
}


@pytest.mark.parametrize("name", sorted(OUTSIDE))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_ablation_outside_the_value_is_refused_by_site_and_axis(fw, corpora, name):
  _, tree, args, first, _ = _mlp(fw, corpora)
  width = _width(fw, corpora)
  where, said = OUTSIDE[name]
  with pytest.raises(fl.ArgumentError, match=rf"^{first}: where=.*{said(width)}.*\. Give "):
    fl.run(tree, args, interventions=[fl.ablate(first, where=where(width))])


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_patch_outside_the_value_is_refused(fw, corpora, jit):
  _, tree, args, first, _ = _mlp(fw, corpora)
  width = _width(fw, corpora)
  patch = fl.patch(first, jnp.zeros(width), where=jnp.s_[:, 99])
  with pytest.raises(fl.ArgumentError, match=rf"^{first}: .*position 99 on axis 1, of size"):
    fl.run(tree, args, interventions=[patch], jit=jit)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_index_on_the_input_is_checked_against_the_input(fw, corpora):
  _, tree, args, _, second = _mlp(fw, corpora)
  width = _width(fw, corpora)
  ablate = fl.ablate(second, on="input", where=jnp.s_[:, width])
  with pytest.raises(fl.ArgumentError, match=rf"^{second}: where=.* the input of shape"):
    fl.run(tree, args, interventions=[ablate])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_index_on_the_input_edits_what_numpy_selects(fw, corpora):
  # Zeroing the second layer's input is zeroing the first layer's output: relu(0) = 0.
  case, tree, args, first, second = _mlp(fw, corpora)
  index = np.s_[:, np.array([3, -1, 3])]
  ablate = fl.ablate(second, on="input", where=jnp.s_[:, jnp.array([3, -1, 3])])
  ours = fl.run(tree, args, interventions=[ablate], jit=False)
  native, _ = fw.native(case, wrap=Wrap(first, _zeroed_at(index)))
  np.testing.assert_array_equal(ours, native)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_index_on_a_part_is_checked_against_the_part(fw):
  x = jnp.ones((2, 4))
  if fw is LINEN:

    class Twin(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.Dense(3)(x)
        return h, jnp.tanh(h)

    model = nn.Sequential([Twin(), lambda h, t: h + t])
    tree, site = fl.unflaxify(model, model.init(jax.random.key(0), x), x), "layers_0"
  else:

    class Twin(nnx.Module):
      def __init__(self, rngs):
        self.linear = nnx.Linear(4, 3, rngs=rngs)

      def __call__(self, x):
        h = self.linear(x)
        return h, jnp.tanh(h)

    model = nnx.Sequential(Twin(nnx.Rngs(0)), lambda h, t: h + t)
    tree, site = fl.unflaxify(model, x), "layers/0"
  with pytest.raises(fl.ArgumentError, match=rf"^{re.escape(site)}: where=\[:, 3\] .*\(2, 3\)"):
    fl.run(tree, x, interventions=[fl.ablate(site, part=1, where=jnp.s_[:, 3])])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_index_inside_a_scan_body_is_checked_against_one_iteration(fw, corpora):
  case = corpora[fw]["scan"]
  tree, (site, iterations) = fw.convert(case), SCANNED[fw]
  args = fw.argument(case).args
  # Position 2 of the stacked capture exists (3 or 4 iterations), not of one iteration's (2, F).
  assert iterations > 2
  with pytest.raises(fl.ArgumentError, match=rf"^{site}: where=\[2\] on the output of shape \(2,"):
    fl.run(tree, args, interventions=[fl.ablate(site, where=jnp.s_[2])])
  with pytest.raises(fl.ArgumentError, match=rf"^{site}: index=\[2\] on the captured value"):
    fl.capture(tree, args, at=site, index=jnp.s_[2])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_index_inside_a_scan_body_edits_every_iteration_as_numpy_selects(fw, corpora):
  case = corpora[fw]["scan"]
  tree, (site, _) = fw.convert(case), SCANNED[fw]
  ablate = fl.ablate(site, where=jnp.s_[1])
  ours = fl.run(tree, fw.argument(case).args, interventions=[ablate], jit=False)
  native, _ = fw.native(case, wrap=Wrap(site, _zeroed_at(np.s_[1])))
  np.testing.assert_array_equal(ours, native)


# --- captures -----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "index, said",
  [
    (jnp.s_[:, 99], "position 99 on axis 1"),
    (jnp.s_[-3], "position -3 on axis 0"),
    (jnp.s_[:, 50:60], "selects nothing"),
    (jnp.s_[:, jnp.array([1, 99])], "from 1 to 99"),
  ],
  ids=["past_the_end", "negative", "empty_slice", "array"],
)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_capture_index_outside_the_value_is_refused(fw, corpora, index, said):
  _, tree, args, first, _ = _mlp(fw, corpora)
  with pytest.raises(fl.ArgumentError, match=rf"^{first}: index=.*{said}"):
    fl.capture(tree, args, at=first, index=index)
  with pytest.raises(fl.ArgumentError, match=rf"^{first}: index=.*{said}"):
    fl.run(tree, args, capture=first, index=index, jit=False)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_capture_index_keeps_what_numpy_selects(fw, corpora):
  case, tree, args, first, _ = _mlp(fw, corpora)
  _, native = fw.native_captures(case)
  index = jnp.s_[::-1, jnp.array([[0], [-1]])]
  _, cache = fl.capture(tree, args, at=first, index=index, jit=False)
  expected = np.asarray(native[(first, "__call__")][0])[::-1, np.array([[0], [-1]])]
  np.testing.assert_array_equal(cache[first], expected)


# --- saved sets ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "make",
  [
    lambda site, w: fl.ablate(site, where=jnp.s_[:, w]),
    lambda site, w: fl.ablate(site, where=jnp.s_[:, -100]),
    lambda site, w: fl.patch(site, jnp.zeros(w), where=jnp.s_[:, 99]),
    lambda site, w: fl.scale(site, 2.0, where=jnp.s_[..., w : w + 16]),
    lambda site, w: fl.ablate(site, where=jnp.s_[:, jnp.array([0, w])]),
  ],
  ids=["past_the_end", "negative", "patch", "empty_slice", "array"],
)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_saved_index_outside_the_value_is_refused_when_run(fw, corpora, tmp_path, make):
  _, tree, args, first, _ = _mlp(fw, corpora)
  fl.save_interventions([make(first, _width(fw, corpora))], tmp_path / "set")
  loaded = fl.load_interventions(tmp_path / "set")
  with pytest.raises(fl.ArgumentError, match=rf"^{first}: where=.*\. Give "):
    fl.run(tree, args, interventions=loaded)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_saved_index_array_records_its_range_again_when_loaded(fw, corpora, tmp_path):
  case, tree, args, first, _ = _mlp(fw, corpora)
  ablate = fl.ablate(first, where=jnp.s_[:, jnp.array([2, 0, 2])])
  fl.save_interventions([ablate], tmp_path / "set")
  (loaded,) = fl.load_interventions(tmp_path / "set")
  assert loaded.index == ablate.index == ("index", ("slice", None, None, None), ("array", 0, 2))
  native, _ = fw.native(case, wrap=Wrap(first, _zeroed_at(np.s_[:, [2, 0, 2]])))
  np.testing.assert_array_equal(fl.run(tree, args, interventions=[loaded], jit=False), native)


# --- compiled runs ------------------------------------------------------------------------


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_new_index_values_outside_the_value_are_refused_by_a_compiled_run(fw, corpora):
  case, tree, args, first, _ = _mlp(fw, corpora)
  width = _width(fw, corpora)
  inside, reversed_ = jnp.array([0, width - 1]), jnp.array([width - 1, 0])
  fl.run(tree, args, interventions=[fl.ablate(first, where=jnp.s_[:, inside])])
  with compilations() as compiled:  # the same range: the compiled run is reused
    ours = fl.run(tree, args, interventions=[fl.ablate(first, where=jnp.s_[:, reversed_])])
  assert compiled == []
  native, _ = fw.native(case, jit=True, wrap=Wrap(first, _zeroed_at(np.s_[:, [width - 1, 0]])))
  np.testing.assert_array_equal(ours, native)
  outside = jnp.array([0, width])  # the same shape and dtype, past the end
  with pytest.raises(fl.ArgumentError, match=rf"^{first}: .*from 0 to {width}"):
    fl.run(tree, args, interventions=[fl.ablate(first, where=jnp.s_[:, outside])])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_index_array_traced_by_your_own_jit_edits_what_numpy_selects(fw, corpora):
  case, tree, args, first, _ = _mlp(fw, corpora)

  @fl.variable_jit  # the tree and the inputs are the program's inputs, as fl.run's are
  def ablated(tree, args, positions):  # made inside the trace: values known when it runs
    ablate = fl.ablate(first, where=jnp.s_[:, positions])
    return fl.run(tree, args, interventions=[ablate], capture=first, jit=False)[1][first]

  _, native = fw.native_captures(case, jit=True)
  expected = np.array(native[(first, "__call__")][0])
  expected[:, [1, -2]] = 0
  np.testing.assert_array_equal(ablated(tree, args, jnp.array([1, -2])), expected)


# --- what is refused when the intervention is made ----------------------------------------

MADE = {
  "bool": (True, "the bool True"),
  "float": (jnp.s_[:, 1.5], "holds 1.5"),
  "two_ellipses": (jnp.s_[..., 0, ...], "more than one '...'"),
  "step_0": (jnp.s_[::0], "step 0"),
  "float_slice": (jnp.s_[0.5:], "bound 0.5 is not an integer"),
  "empty_array": (jnp.s_[:, jnp.zeros(0, jnp.int32)], "empty array"),
  "float_array": (jnp.s_[:, jnp.array([1.0])], "dtype float32"),
  "bool_array_inside": (jnp.s_[:, jnp.array([True, False])], "boolean array inside"),
  "false_mask": (jnp.zeros((2, 1), bool), "False everywhere"),
  "huge_array": (jnp.s_[:, np.array([2**40])], "too large"),
  "huge_list": (jnp.s_[:, [10**30]], "not a list of integer positions"),
}


@pytest.mark.parametrize("name", sorted(MADE))
def test_where_that_is_no_index_is_refused_when_made_naming_the_site(name):
  where, said = MADE[name]
  with pytest.raises(
    fl.ArgumentError, match=rf"^fl\.ablate\('Block_0'\): where=.*{re.escape(said)}"
  ):
    fl.ablate("Block_0", where=where)


# --- the property: NumPy's selection, or a refusal ----------------------------------------

_POSITION = st.integers(-5, 5)
_ENTRY = st.one_of(
  _POSITION,
  st.sampled_from([10**30, -(10**30)]),
  st.builds(
    slice,
    st.none() | _POSITION,
    st.none() | _POSITION,
    st.sampled_from([None, 1, 2, -1, -3]),
  ),
  st.just(Ellipsis),
  st.just(None),
  hnp.arrays(np.int32, hnp.array_shapes(min_dims=0, max_dims=2, min_side=0), elements=_POSITION),
)
# A bare None is no index at all (the whole value), not NumPy's new axis: only in a tuple.
_INDEX = st.one_of(_ENTRY.filter(lambda e: e is not None), st.lists(_ENTRY, max_size=4).map(tuple))
_LEAD = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
_PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tiny(fw):
  """A model of one dense layer (4 -> 3), its converted tree, its site and a native call."""
  x = jnp.ones((2, 4))
  if fw is LINEN:
    model = nn.Sequential([nn.Dense(3)])
    variables = model.init(jax.random.key(0), x)
    return fl.unflaxify(model, variables, x), "layers_0", lambda x: model.apply(variables, x)
  model = nnx.Sequential(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
  return fl.unflaxify(model, x), "layers/0", model


_TINY = {}


def _tiny_cached(fw):
  if fw not in _TINY:
    _TINY[fw] = _tiny(fw)
  return _TINY[fw]


def _numpy_selection(shape, index):
  """Where NumPy's `value[index] = ...` writes, or None if NumPy refuses or writes nothing."""
  selected = np.zeros(shape, bool)
  try:
    selected[index] = True
  except (IndexError, ValueError, OverflowError):
    return None
  return selected if selected.any() else None


def _as_jax(index):
  entries = index if isinstance(index, tuple) else (index,)
  converted = tuple(jnp.asarray(e) if isinstance(e, np.ndarray) else e for e in entries)
  return converted if isinstance(index, tuple) else converted[0]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@_PROPERTY
@given(lead=_LEAD, index=_INDEX, data=st.data())
def test_where_edits_exactly_what_numpy_selects_or_is_refused(fw, lead, index, data):
  tree, site, native = _tiny_cached(fw)
  x = data.draw(hnp.arrays(np.float32, (*lead, 4), elements=st.floats(-2, 2, width=32)))
  value = np.asarray(native(jnp.asarray(x)))
  selected = _numpy_selection(value.shape, index)

  def ours():
    ablate = fl.ablate(site, where=_as_jax(index))
    return fl.run(tree, jnp.asarray(x), interventions=[ablate], jit=False)

  if selected is None:  # refused when made (fl.ablate('site'): ...) or when run (site: ...)
    with pytest.raises(fl.FlaxlensError, match=rf"^(fl\.ablate\('{re.escape(site)}'\)|{site}):"):
      ours()
    return
  expected = value.copy()
  expected[selected] = 0
  np.testing.assert_array_equal(ours(), expected)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@_PROPERTY
@given(lead=_LEAD, data=st.data())
def test_a_mask_edits_where_it_broadcasts_true_or_is_refused(fw, lead, data):
  tree, site, native = _tiny_cached(fw)
  x = jnp.ones((*lead, 4))
  value = np.asarray(native(x))
  rank = data.draw(st.integers(0, value.ndim + 1))
  shape = tuple(data.draw(st.sampled_from([1, 2, 3, 4])) for _ in range(rank))
  mask = data.draw(hnp.arrays(np.bool_, shape))
  try:
    selected = np.broadcast_to(mask, value.shape)
  except ValueError:
    selected = None
  if selected is None or not selected.any():
    with pytest.raises(fl.FlaxlensError, match=re.escape(site)):
      fl.run(tree, x, interventions=[fl.ablate(site, where=jnp.asarray(mask))], jit=False)
    return
  expected = value.copy()
  expected[selected] = 0
  ours = fl.run(tree, x, interventions=[fl.ablate(site, where=jnp.asarray(mask))], jit=False)
  np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@_PROPERTY
@given(lead=_LEAD, index=_INDEX)
def test_a_capture_index_keeps_exactly_what_numpy_reads_or_is_refused(fw, lead, index):
  tree, site, native = _tiny_cached(fw)
  x = jnp.ones((*lead, 4))
  value = np.asarray(native(x))
  try:
    expected = value[index]
  except (IndexError, ValueError, OverflowError):
    expected = None
  if expected is None or expected.size == 0:  # refused as given, or on the site's value
    with pytest.raises(fl.FlaxlensError, match=rf"^(fl\.run/fl\.capture|{site}): index="):
      fl.capture(tree, x, at=site, index=_as_jax(index), jit=False)
    return
  _, cache = fl.capture(tree, x, at=site, index=_as_jax(index), jit=False)
  np.testing.assert_array_equal(cache[site], expected)
