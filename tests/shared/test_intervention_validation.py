"""Interventions that cannot apply are refused by name, before anything is compiled."""

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

import flaxlens as fl

FRAMEWORKS = [LINEN, NNX]
# Per framework: the corpus case, its first and second layer, a layer class it never calls.
MODELS = {
  LINEN: ("mlp", "Dense_0", "Dense_1", nn.Conv),
  NNX: ("mlp", "hidden", "out", nnx.Conv),
}


def _model(fw, corpora):
  name, first, second, absent = MODELS[fw]
  case = corpora[fw][name]
  tree = fw.convert(case)
  args = fw.argument(case).args
  _, cache = fl.capture(tree, args, at=first)
  return case, tree, args, first, second, absent, cache[first].shape


# No corpus model returns a tuple from a call or calls a module by keyword only; these do.
class LinenTwin(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(3)(x)
    return h, jnp.tanh(h)


class LinenKeywords(nn.Module):
  @nn.compact
  def __call__(self, x):
    first, second = LinenTwin()(x)
    return nn.Dense(2)(inputs=first + second)


class NNXTwin(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    h = self.linear(x)
    return h, jnp.tanh(h)


class NNXKeywords(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.twin = NNXTwin(rngs)
    self.out = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    first, second = self.twin(x)
    return self.out(inputs=first + second)


def _structured(fw):
  """A tree with a call returning a tuple and a call taking no positional argument."""
  x = jnp.ones((2, 4))
  if fw is LINEN:
    model = LinenKeywords()
    return fl.unflaxify(model, model.init(jax.random.key(0), x), x), x, "LinenTwin_0", "Dense_0"
  return fl.unflaxify(NNXKeywords(nnx.Rngs(0)), x), x, "twin", "out"


# --- sites that match nothing -------------------------------------------------------------


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_site_that_matches_nothing_lists_the_closest_names(fw, corpora):
  _, tree, args, first, *_ = _model(fw, corpora)
  with pytest.raises(fl.SelectionError, match=rf"'{first[:-1]}'\. Closest: \[.*'{first}'"):
    fl.run(tree, args, interventions=[fl.ablate(first[:-1])])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_one_site_of_a_list_that_matches_nothing_is_refused(fw, corpora):
  _, tree, args, first, second, *_ = _model(fw, corpora)
  with pytest.raises(fl.SelectionError, match=f"'{second}x'"):
    fl.run(tree, args, interventions=[fl.ablate([first, f"{second}x"])])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_capture_site_that_matches_nothing_is_refused(fw, corpora):
  _, tree, args, first, *_ = _model(fw, corpora)
  with pytest.raises(fl.SelectionError, match=f"Closest: .*'{first}'"):
    fl.capture(tree, args, at=f"{first}x")


@pytest.mark.parametrize("dtype", ["foo", "U", object])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_capture_dtype_that_jax_does_not_compute_with_is_refused_before_running(
  fw, corpora, dtype
):
  _, tree, args, first, *_ = _model(fw, corpora)
  refused = rf"^fl\.run/fl\.capture: dtype={re.escape(repr(dtype))} is not a dtype .* Give "
  with compilations() as compiled:
    with pytest.raises(fl.ArgumentError, match=refused):
      fl.capture(tree, args, at=first, dtype=dtype)
    with pytest.raises(fl.ArgumentError, match=refused):
      fl.run(tree, args, capture=first, dtype=dtype, jit=False)
  assert compiled == []


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_an_empty_list_of_sites_is_refused_by_capture_as_by_a_patch(fw, corpora, empty):
  """No site is a mistake (a glob list built by a program that found nothing): refused
  alike whether it is captured or patched, not answered with an empty cache."""
  _, tree, args, *_ = _model(fw, corpora)
  for capture in (
    lambda: fl.capture(tree, args, at=empty),
    lambda: fl.run(tree, args, capture=empty),
  ):
    with pytest.raises(fl.SelectionError, match="An empty list of sites selects no call"):
      capture()
  with pytest.raises(fl.SelectionError, match="An empty list of sites selects no call"):
    fl.run(tree, args, interventions=[fl.ablate(empty)])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_module_class_the_model_never_calls_is_refused_with_the_classes_it_calls(fw, corpora):
  _, tree, args, first, _, absent, _ = _model(fw, corpora)
  called = tree.select().at_path(first).get().module_type.__name__
  with pytest.raises(fl.SelectionError, match=rf"a {absent.__name__} .*'{called}'"):
    fl.run(tree, args, interventions=[fl.ablate(absent)])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_predicate_that_matches_nothing_is_refused(fw, corpora):
  _, tree, args, *_ = _model(fw, corpora)
  with pytest.raises(fl.SelectionError, match="matches no call"):
    fl.run(tree, args, interventions=[fl.ablate(lambda node: False)])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_call_node_of_another_tree_is_refused(fw, corpora):
  _, tree, args, first, *_ = _model(fw, corpora)
  other, x, twin, _ = _structured(fw)
  with pytest.raises(fl.SelectionError, match="is not a call of"):
    fl.run(tree, args, interventions=[fl.ablate(other.select().at_path(twin).get())])


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_call_node_given_as_the_site_is_edited_like_the_native_call(fw, corpora, jit):
  case, tree, args, first, *_ = _model(fw, corpora)
  node = tree.select().at_path(first).get()
  out = fl.run(tree, args, interventions=[fl.ablate(node)], jit=jit)
  expected, _ = fw.native(case, wrap=Wrap(first, lambda output, *a: jnp.zeros_like(output)))
  np.testing.assert_array_equal(out, expected)


# --- values that cannot apply -------------------------------------------------------------


@pytest.mark.parametrize(
  "make, what",
  [
    (lambda site, shape: fl.patch(site, jnp.ones((shape[0] + 1, shape[1]))), "the patched value"),
    (lambda site, shape: fl.steer(site, jnp.ones(shape[-1] + 1)), "the steering vector"),
    (lambda site, shape: fl.steer(site, jnp.ones(shape[-1]), jnp.ones(3)), "alpha"),
    (lambda site, shape: fl.scale(site, jnp.ones((shape[-1], 1))), "the factor"),
    (lambda site, shape: fl.ablate(site, "mean", jnp.ones((2, 5))), "the mean of the reference"),
    (
      lambda site, shape: fl.ablate(site, "resample", jnp.ones((2, 5)), key=jax.random.key(0)),
      "the resampled reference",
    ),
  ],
  ids=["patch", "steer_vector", "steer_alpha", "scale", "mean", "resample"],
)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_value_that_does_not_broadcast_names_the_site_and_its_shape(fw, corpora, make, what):
  _, tree, args, first, _, _, shape = _model(fw, corpora)
  expected = re.escape(f"{first}: {what} has shape") + ".*" + re.escape(f"output's shape {shape}")
  with pytest.raises(fl.ArgumentError, match=expected):
    fl.run(tree, args, interventions=[make(first, shape)])


@pytest.mark.parametrize(
  "maker, what", [(fl.patch, "patched value"), (fl.steer, "steering vector")]
)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_value_that_fits_no_shape_under_an_index_names_the_region_shape_too(
  fw, corpora, maker, what
):
  """Under an index where=, the value may also have the shape of the region it selects
  (fl.capture(index=) gives it so): the refusal names that shape among those to give."""
  _, tree, args, first, _, _, shape = _model(fw, corpora)
  wrong = jnp.ones((shape[0] + 1, 2))
  region = (*shape[:-1], 2)
  expected = (
    re.escape(f"{first}: the {what} has shape {wrong.shape}")
    + ".*"
    + re.escape(f"or of the region where= selects, {region}.")
  )
  with pytest.raises(fl.ArgumentError, match=expected):
    fl.run(tree, args, interventions=[maker(first, wrong, where=jnp.s_[..., 1:3])])
  fits = fl.run(tree, args, interventions=[maker(first, jnp.ones(region), where=jnp.s_[..., 1:3])])
  assert fits.shape == fl.run(tree, args).shape


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_value_whose_dtype_does_not_cast_to_the_site_is_refused(fw, corpora):
  _, tree, args, first, _, _, shape = _model(fw, corpora)
  vector = jnp.ones(shape[-1], jnp.complex64)
  with pytest.raises(fl.ArgumentError, match=f"{first}: .*complex64.*dtype float32"):
    fl.run(tree, args, interventions=[fl.steer(first, vector)])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_value_that_cannot_apply_is_refused_before_anything_compiles(fw, corpora):
  _, tree, args, first, _, _, shape = _model(fw, corpora)
  wrong, right = jnp.ones(shape[-1] + 1), jnp.ones(shape[-1])
  with compilations() as compiled:
    with pytest.raises(fl.ArgumentError, match=first):
      fl.run(tree, args, interventions=[fl.steer(f"{first}*", wrong)])
  assert compiled == []
  with compilations() as compiled:  # a run that can apply is compiled, and seen compiling
    fl.run(tree, args, interventions=[fl.steer(f"{first}*", right)])
  assert compiled


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_mask_of_higher_rank_than_the_site_is_refused(fw, corpora):
  _, tree, args, first, _, _, shape = _model(fw, corpora)
  mask = jnp.ones((1, *shape), bool)
  with pytest.raises(fl.ArgumentError, match=rf"{first}: the mask .* rank 3 .* rank 2"):
    fl.run(tree, args, interventions=[fl.ablate(first, where=mask)])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_mask_that_does_not_broadcast_is_refused(fw, corpora):
  _, tree, args, first, _, _, shape = _model(fw, corpora)
  mask = jnp.ones(shape[-1] + 1, bool)
  with pytest.raises(fl.ArgumentError, match=rf"{first}: the mask of where= has shape"):
    fl.run(tree, args, interventions=[fl.ablate(first, where=mask)])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_index_with_more_axes_than_the_site_is_refused(fw, corpora):
  _, tree, args, first, *_ = _model(fw, corpora)
  with pytest.raises(fl.ArgumentError, match=f"{first}: where=.*at most 2 axes"):
    fl.run(tree, args, interventions=[fl.ablate(first, where=jnp.s_[:, :, 0])])


# --- parts and inputs ---------------------------------------------------------------------


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_part_of_an_array_output_is_refused(fw, corpora):
  _, tree, args, first, *_ = _model(fw, corpora)
  with pytest.raises(fl.ArgumentError, match=f"{first}: part=0, but the output is one array"):
    fl.run(tree, args, interventions=[fl.ablate(first, part=0)])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_part_a_tuple_output_lacks_is_refused_with_its_parts(fw):
  tree, x, twin, _ = _structured(fw)
  with pytest.raises(
    fl.ArgumentError, match=rf"{twin}: part=2, .*tuple .*whose parts are \[0, 1\]"
  ):
    fl.run(tree, x, interventions=[fl.ablate(twin, part=2)])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_tuple_output_without_part_is_refused(fw):
  tree, x, twin, _ = _structured(fw)
  with pytest.raises(fl.ArgumentError, match=f"{twin}: the output is a tuple .* Pass part="):
    fl.run(tree, x, interventions=[fl.ablate(twin)])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_on_input_of_a_call_without_positional_arguments_is_refused(fw):
  tree, x, _, keywords = _structured(fw)
  with pytest.raises(fl.ArgumentError, match=f"{keywords}: on='input' .* takes none"):
    fl.run(tree, x, interventions=[fl.scale(keywords, 2.0, on="input")])


# --- operands that are not values, refused when the intervention is made ------------------

MAKERS = {
  "steer_alpha": (lambda: fl.steer("Block_0", jnp.ones(4), alpha="big"), "steer", "alpha='big'"),
  "steer_vector": (lambda: fl.steer("Block_0", None), "steer", "vector=None"),
  "scale_factor": (lambda: fl.scale("Block_0", "half"), "scale", "factor='half'"),
  "patch_value": (lambda: fl.patch("Block_0", {"a": 1}), "patch", "value="),
  "patch_strings": (lambda: fl.patch("Block_0", np.array(["x"])), "patch", "dtype <U1"),
  "modify_fn": (lambda: fl.modify("Block_0", 3), "modify", "fn=3 is not callable"),
  "modify_operand": (lambda: fl.modify("Block_0", jnp.tanh, "x"), "modify", "operand 0="),
  "ablate_how": (lambda: fl.ablate("Block_0", how="one"), "ablate", "how= is"),
  "ablate_how_list": (lambda: fl.ablate("Block_0", how=["zero"]), "ablate", "how= is"),
  "mean_without_reference": (
    lambda: fl.ablate("Block_0", "mean"),
    "ablate",
    "needs the site's values",
  ),
  "mean_of_text": (lambda: fl.ablate("Block_0", "mean", "abc"), "ablate", "reference='abc'"),
  "mean_of_scalar": (lambda: fl.ablate("Block_0", "mean", 3.0), "ablate", "is a scalar"),
  "resample_without_key": (
    lambda: fl.ablate("Block_0", "resample", jnp.ones((2, 4))),
    "ablate",
    "needs a JAX key",
  ),
  "resample_key_int": (
    lambda: fl.ablate("Block_0", "resample", jnp.ones((2, 4)), key=3),
    "ablate",
    "key=3 is not a JAX random key",
  ),
  "on": (lambda: fl.scale("Block_0", 2.0, on="out"), "scale", "on= is 'output' or 'input'"),
  "part_bool": (lambda: fl.ablate("Block_0", part=True), "ablate", "part=True names no part"),
  "part_float": (lambda: fl.steer("Block_0", 1.0, part=1.0), "steer", "part=1.0 names no part"),
  # Numbers JAX's 32-bit dtypes cannot hold (an OverflowError, a wrapped int, an inf).
  "scale_int_beyond_int32": (
    lambda: fl.scale("Block_0", 2**40),
    "scale",
    "factor=1099511627776 is outside the range of int32",
  ),
  "steer_int64_beyond_int32": (
    lambda: fl.steer("Block_0", np.array([1, -(2**40)])),
    "steer",
    "vector (an array int64[2]) holds -1099511627776, outside the range of int32",
  ),
  "scale_float_beyond_float32": (
    lambda: fl.scale("Block_0", 1e300),
    "scale",
    "factor=1e+300 is beyond the range of float32",
  ),
}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_an_operand_that_is_no_value_is_refused_naming_the_site_and_the_fix(name):
  make, maker, said = MAKERS[name]
  expected = rf"^fl\.{maker}\('Block_0'\): .*{re.escape(said)}.*[.;] (Give|Pass) "
  with pytest.raises(fl.ArgumentError, match=expected):
    make()


@pytest.mark.parametrize(
  "at, shown",
  [(nn.Dense, "Dense"), (["Block_0", "Block_1"], "['Block_0', 'Block_1']")],
  ids=["class", "list"],
)
def test_a_refused_operand_names_a_site_given_as_a_class_or_a_list(at, shown):
  with pytest.raises(fl.ArgumentError, match=rf"^fl\.scale\({re.escape(shown)}\): factor="):
    fl.scale(at, "half")


NON_FINITE = {
  "patch_nan": (lambda: fl.patch("Block_0", jnp.full((2, 4), jnp.nan)), "patch", "value"),
  "steer_inf_vector": (
    lambda: fl.steer("Block_0", jnp.ones(4).at[1].set(jnp.inf)),
    "steer",
    "vector",
  ),
  "steer_nan_alpha": (
    lambda: fl.steer("Block_0", jnp.ones(4), alpha=float("nan")),
    "steer",
    "alpha",
  ),
  "scale_minus_inf": (lambda: fl.scale("Block_0", -np.inf), "scale", "factor"),
  "mean_nan_reference": (
    lambda: fl.ablate("Block_0", "mean", jnp.ones((3, 4)).at[0, 0].set(jnp.nan)),
    "ablate",
    "reference",
  ),
  "low_rank_nan_bias": (
    lambda: fl.low_rank_edit("Block_0", jnp.eye(2, 4), bias=jnp.array([0.0, jnp.nan])),
    "low_rank_edit",
    "bias",
  ),
  "interchange_inf_source": (
    lambda: fl.interchange("Block_0", jnp.eye(4), jnp.full(4, jnp.inf), 2),
    "interchange",
    "source",
  ),
  "modify_nan_operand": (
    lambda: fl.modify("Block_0", lambda argument, y, b: y + b, jnp.nan),
    "modify",
    "operand 0",
  ),
}


@pytest.mark.parametrize("name", sorted(NON_FINITE))
def test_an_operand_holding_nan_or_inf_is_refused_when_made_naming_maker_site_and_fix(name):
  make, maker, operand = NON_FINITE[name]
  expected = rf"^fl\.{maker}\('Block_0'\): {operand} holds nan or inf\. Give finite values"
  with pytest.raises(fl.ArgumentError, match=expected):
    make()


def test_a_traced_operand_is_not_checked_and_its_run_is_the_native_one():
  # Inside jax.jit the vector has no values yet: the intervention is made, unchecked, and
  # the run gives what Flax gives with the same value added by hand (nan included).
  model, x = nn.Dense(3), jnp.ones((1, 2))
  variables = model.init(jax.random.key(0), x)
  tree = fl.unflaxify(model, variables, x)

  @jax.jit
  def steered(vector):
    edit = fl.steer("Dense.__call__", vector)
    return fl.run(tree, x, interventions=[edit], jit=False)

  vector = jnp.array([1.0, jnp.nan, 2.0])
  np.testing.assert_array_equal(steered(vector), model.apply(variables, x) + vector)
