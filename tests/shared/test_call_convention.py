"""The tools take the model's arguments as one value, so no option shadows a model argument.

A model whose call takes keyword arguments named like flaxlens' options (`inputs`,
`index`, `at`, `jit`, `interventions`, ...) runs through every tool as natively; a call
written with the model's arguments spread over a tool's own is refused with the form to
use; `None` or a non-tree where a tool takes a tree, interventions or a metric is refused
by name.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl

X = jax.random.normal(jax.random.key(0), (2, 3, 4))
# Keyword arguments named as the tools' options: each one is the model's, never flaxlens'.
KWARGS = {"inputs": X, "index": 2.0, "at": 0.5, "jit": -1.0, "interventions": 3.0}


class LinenTagger(nn.Module):
  @nn.compact
  def __call__(self, *, inputs, index, at, jit, interventions):
    hidden = nn.Dense(5, name="dense")(inputs) * index + at
    return nn.Dense(2, name="head")(hidden) * jit + interventions


class NNXTagger(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.dense = nnx.Linear(4, 5, rngs=rngs)
    self.head = nnx.Linear(5, 2, rngs=rngs)

  def __call__(self, *, inputs, index, at, jit, interventions):
    hidden = self.dense(inputs) * index + at
    return self.head(hidden) * jit + interventions


class Native:
  """A framework's tagger: converted, called natively, its layers' kernels and biases."""

  def __init__(self, name: str):
    self.name = name
    if name == "linen":
      model = LinenTagger()
      variables = model.init(jax.random.key(1), **KWARGS)
      self.tree = fl.unflaxify(model, variables, **KWARGS)
      self.call = lambda **kw: model.apply(variables, **kw)
      self.params = variables["params"]
      self.exported = lambda tree: (model, tree.export())
    else:
      model = NNXTagger(nnx.Rngs(1))
      self.tree = fl.unflaxify(model, **KWARGS)
      self.call = lambda **kw: model(**kw)
      self.params = {
        name: {"kernel": layer.kernel.value, "bias": layer.bias.value}
        for name, layer in (("dense", model.dense), ("head", model.head))
      }
      self.exported = lambda tree: tree.export()

  def dense_output(self, inputs):
    return inputs @ self.params["dense"]["kernel"] + self.params["dense"]["bias"]

  def __repr__(self) -> str:
    return self.name


@pytest.fixture(params=["linen", "nnx"], scope="module")
def tagger(request):
  return Native(request.param)


CALL = fl.ArgsAndKwargs.capture(**KWARGS)


def test_run_passes_keywords_named_like_its_options_to_the_model(tagger):
  np.testing.assert_array_equal(fl.run(tagger.tree, CALL), tagger.call(**KWARGS))


def test_capture_keeps_its_own_index_apart_from_the_models(tagger):
  out, cache = fl.capture(tagger.tree, CALL, at="dense", index=jnp.s_[:, -1], jit=False)
  np.testing.assert_array_equal(out, tagger.call(**KWARGS))
  np.testing.assert_allclose(cache["dense"], tagger.dense_output(X)[:, -1], rtol=1e-6)


def test_interventions_apply_while_the_model_takes_an_interventions_argument(tagger):
  vector = jnp.arange(5.0)
  steered = fl.run(tagger.tree, CALL, interventions=[fl.steer("dense", vector, alpha=2.0)])
  # dense's output feeds `* index + at`: steering it is shifting `at` by 2 * vector * index.
  shifted = {**KWARGS, "at": KWARGS["at"] + 2.0 * vector * KWARGS["index"]}
  np.testing.assert_allclose(steered, tagger.call(**shifted), rtol=1e-5, atol=1e-5)


def test_a_sweep_of_identical_runs_gives_the_native_metric_at_every_site(tagger):
  result = fl.sweep(tagger.tree, CALL, CALL, ["dense", "head"], lambda out: out[0, 0, 1])
  np.testing.assert_array_equal(result.values, np.full(2, tagger.call(**KWARGS)[0, 0, 1]))


def test_attribution_reads_each_runs_keyword_arguments(tagger):
  corrupted = fl.ArgsAndKwargs.capture(**{**KWARGS, "inputs": -X})
  result = fl.attribute(tagger.tree, CALL, corrupted, "dense", lambda out: out.sum())
  # The model is affine after `dense`: d sum(out) / d dense = index * jit * head's row sums.
  gradient = KWARGS["index"] * KWARGS["jit"] * tagger.params["head"]["kernel"].sum(axis=1)
  difference = tagger.dense_output(X) - tagger.dense_output(-X)
  np.testing.assert_allclose(result.values, (difference * gradient).sum(), rtol=1e-5)


def test_grad_at_differentiates_through_the_models_keyword_arguments(tagger):
  value, grads = fl.grad_at(tagger.tree, CALL, "head", lambda out: out.sum())
  np.testing.assert_allclose(value, tagger.call(**KWARGS).sum(), rtol=1e-6)
  # out = head * jit + interventions, so d sum(out) / d head = jit everywhere.
  np.testing.assert_array_equal(grads["head"], np.full((2, 3, 2), KWARGS["jit"]))


def test_fold_and_check_equivalence_take_the_arguments_as_one_value(tagger):
  vector = jnp.arange(5.0)
  folded = fl.fold(tagger.tree, CALL, [fl.steer("dense", vector)])
  steered = fl.run(tagger.tree, CALL, interventions=[fl.steer("dense", vector)])
  np.testing.assert_allclose(fl.run(folded, CALL), steered, rtol=1e-5, atol=1e-5)
  assert fl.check_equivalence(tagger.tree, tagger.exported(tagger.tree), CALL)


def test_one_value_a_tuple_and_args_and_kwargs_are_the_same_call():
  model = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)])
  variables = model.init(jax.random.key(0), X)
  tree = fl.unflaxify(model, variables, X)
  native = model.apply(variables, X)
  for args in (X, (X,), fl.ArgsAndKwargs.capture(X)):
    np.testing.assert_array_equal(fl.run(tree, args), native)


def test_a_tuple_is_the_positional_arguments_and_a_tuple_argument_is_wrapped_once():
  class Pair(nn.Module):
    @nn.compact
    def __call__(self, a, b=None):
      first, second = a if b is None else (a, b)
      return nn.Dense(2)(first - second)

  variables = Pair().init(jax.random.key(0), X, X * 2)
  tree = fl.unflaxify(Pair(), variables, X, X * 2)
  native = Pair().apply(variables, X, X * 2)
  np.testing.assert_array_equal(fl.run(tree, (X, X * 2)), native)
  np.testing.assert_array_equal(fl.run(tree, ((X, X * 2),)), native)


# --- refusals -----------------------------------------------------------------------------

OLD_FORMS = {
  "run": lambda t: fl.run(t, X, X, interventions=[]),
  "capture": lambda t: fl.capture(t, X, at="dense", train=False),
  "sweep": lambda t: fl.sweep(t, X, X, "dense", lambda o: o.sum(), deterministic=True),
  "attribute": lambda t: fl.attribute(t, X, X, "dense", lambda o: o.sum(), train=True),
  "grad_at": lambda t: fl.grad_at(t, lambda o: o.sum(), X, X, at="dense"),
  "fold": lambda t: fl.fold(t, [], X, X),
  "check_equivalence": lambda t: fl.check_equivalence(t, t, X, train=True),
}


@pytest.mark.parametrize("tool", sorted(OLD_FORMS))
def test_the_models_arguments_spread_over_a_tools_options_are_refused_with_the_form_to_use(
  tagger, tool
):
  with pytest.raises(fl.ArgumentError, match=rf"fl\.{tool}: .*one value after the tree") as e:
    OLD_FORMS[tool](tagger.tree)
  assert "fl.ArgsAndKwargs.capture(*args, **kwargs)" in str(e.value)


NOT_A_TREE = {
  "run": lambda t: fl.run(t, X),
  "capture": lambda t: fl.capture(t, X),
  "sweep": lambda t: fl.sweep(t, X, X, "dense", lambda o: o.sum()),
  "attribute": lambda t: fl.attribute(t, X, X, "dense", lambda o: o.sum()),
  "grad_at": lambda t: fl.grad_at(t, X, "dense", lambda o: o.sum()),
  "fold": lambda t: fl.fold(t, X, []),
}


@pytest.mark.parametrize("tool", sorted(NOT_A_TREE))
@pytest.mark.parametrize("tree", [None, nn.Dense(2)], ids=["None", "a module"])
def test_none_or_a_module_for_the_tree_is_refused_naming_unflaxify(tool, tree):
  with pytest.raises(
    fl.ArgumentError, match=rf"fl\.{tool}: tree must be a converted tree.*unflaxify"
  ):
    NOT_A_TREE[tool](tree)


BAD_INTERVENTIONS = {
  "run": lambda t, bad: fl.run(t, CALL, interventions=bad),
  "capture": lambda t, bad: fl.capture(t, CALL, interventions=bad),
  "fold": lambda t, bad: fl.fold(t, CALL, bad),
}


@pytest.mark.parametrize("tool", sorted(BAD_INTERVENTIONS))
@pytest.mark.parametrize("bad", [None, "dense", 3, [None], [fl.ablate("dense"), "head"]], ids=repr)
def test_anything_but_a_list_of_interventions_is_refused_by_name(tagger, tool, bad):
  refused = r"interventions must be a list of interventions \(fl\.ablate"
  with pytest.raises(fl.ArgumentError, match=refused):
    BAD_INTERVENTIONS[tool](tagger.tree, bad)


def test_one_intervention_not_in_a_list_runs_as_a_list_of_one(tagger):
  edit = fl.ablate("dense")
  np.testing.assert_array_equal(
    fl.run(tagger.tree, CALL, interventions=edit),
    fl.run(tagger.tree, CALL, interventions=[edit]),
  )


METRIC_TOOLS = {
  "sweep": lambda t, m: fl.sweep(t, CALL, CALL, "dense", m),
  "attribute": lambda t, m: fl.attribute(t, CALL, CALL, "dense", m),
  "grad_at": lambda t, m: fl.grad_at(t, CALL, "dense", m),
}


@pytest.mark.parametrize("tool", sorted(METRIC_TOOLS))
@pytest.mark.parametrize("metric", [None, "logit_diff"], ids=repr)
def test_a_metric_that_is_not_a_function_is_refused_by_name(tagger, tool, metric):
  with pytest.raises(fl.ArgumentError, match=rf"fl\.{tool}: metric must be a function"):
    METRIC_TOOLS[tool](tagger.tree, metric)


# --- a clean and a corrupted run ------------------------------------------------------------

RUN_PAIR_TOOLS = {
  "sweep": lambda t, clean, corrupted: fl.sweep(t, clean, corrupted, "dense", lambda o: o.sum()),
  "attribute": lambda t, clean, corrupted: fl.attribute(
    t, clean, corrupted, "dense", lambda o: o.sum()
  ),
  "path_patch": lambda t, clean, corrupted: fl.path_patch(
    t, clean, corrupted, "dense", "head", lambda o: o.sum()
  ),
}


@pytest.mark.parametrize("tool", sorted(RUN_PAIR_TOOLS))
def test_clean_and_corrupted_arguments_of_other_shapes_are_refused_naming_both(tagger, tool):
  fewer = fl.ArgsAndKwargs.capture(**{**KWARGS, "inputs": X[:1]})
  with pytest.raises(fl.ArgumentError) as raised:
    RUN_PAIR_TOOLS[tool](tagger.tree, CALL, fewer)
  message = str(raised.value)
  assert message.startswith(f"fl.{tool} of ")
  assert (
    "the clean and the corrupted run's arguments differ in shape: kwargs['inputs'] is"
    " float32[2, 3, 4] in the clean run and float32[1, 3, 4] in the corrupted run." in message
  )
  assert "fl.modify" not in message
  assert message.endswith("or take as many examples for each run).")


@pytest.mark.parametrize("tool", sorted(RUN_PAIR_TOOLS))
def test_clean_and_corrupted_arguments_of_another_structure_are_refused(tagger, tool):
  other = fl.ArgsAndKwargs.capture(X, **{k: v for k, v in KWARGS.items() if k != "inputs"})
  refused = (
    r"differ in structure: the clean run's are \(at=0\.5, .*inputs=float32\[2, 3, 4\].*\),"
    r" the corrupted run's \(float32\[2, 3, 4\], at=0\.5, "
  )
  with pytest.raises(fl.ArgumentError, match=refused):
    RUN_PAIR_TOOLS[tool](tagger.tree, CALL, other)


def test_clean_and_corrupted_arguments_may_differ_in_python_numbers(tagger):
  corrupted = fl.ArgsAndKwargs.capture(**{**KWARGS, "index": -2.0})
  result = fl.sweep(tagger.tree, CALL, corrupted, "head", lambda out: out[0, 0, 1])
  # head's output patched from the clean run: the rest of the call is the same in both.
  np.testing.assert_allclose(result.values, [tagger.call(**KWARGS)[0, 0, 1]], rtol=1e-6)
  np.testing.assert_allclose(result.corrupted, tagger.call(**corrupted.kwargs)[0, 0, 1], rtol=1e-6)


def test_one_clean_example_against_a_corrupted_batch_is_swept_as_native_patching():
  """The clean run's values broadcast into the corrupted run (one clean prompt, several
  corrupted ones): the sweep's cell is the native run with the clean value patched in."""
  model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
  clean, corrupted = jnp.ones((1, 3)), -jnp.arange(6.0).reshape(2, 3)
  variables = model.init(jax.random.key(0), clean)
  tree = fl.unflaxify(model, variables, clean)
  swept = fl.sweep(tree, clean, corrupted, "layers_0", lambda out: out.sum())

  _, sown = model.apply(variables, clean, capture_intermediates=True, mutable=["intermediates"])
  clean_value = sown["intermediates"]["layers_0"]["__call__"][0]

  def patch(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return jnp.broadcast_to(clean_value, out.shape) if context.module.name == "layers_0" else out

  with nn.intercept_methods(patch):
    native = model.apply(variables, corrupted)
  np.testing.assert_allclose(np.asarray(swept.values).reshape(-1)[0], native.sum(), rtol=1e-6)
