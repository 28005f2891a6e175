"""Captures under a memory budget: `fl.capture(..., budget=N)` splits a batch whose captures
exceed N bytes into chunks and returns what the unbudgeted capture returns.

The unbudgeted `fl.capture` is proven equal to Flax's own capture elsewhere
(test_capture.py); here a budgeted capture is compared with it and, once, with Flax's own
capture. Models with weights and inputs that are multiples of 1/4 make every float32
operation exact, so that any correct computation agrees bit for bit however XLA batches
it; with real weights a chunk is another program than the whole batch, which XLA may
round differently (measured on CPU: at most 3.8e-6, docs/interventions.md).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal, compilations
from flax import nnx
from frameworks import LINEN, NNX

import flaxlens as fl

FRAMEWORKS = [LINEN, NNX]
WIDTH = 8


def _quarters(x):
  return jnp.clip(jnp.round(x * 4) / 4, -2.0, 2.0)


def _inputs(batch, exact=True):
  x = jax.random.normal(jax.random.key(5), (batch, 3, WIDTH))
  return _quarters(x) if exact else x


def _stack(framework, exact=True, layers=4):
  """A Dense/relu stack of `layers` layers (quarter-valued weights if `exact`), converted
  on a batch of 2; returns the tree and the native model (Linen: `(module, variables)`)."""
  x = _inputs(2, exact)
  fix = _quarters if exact else (lambda v: v)
  if framework is LINEN:
    parts = []
    for _ in range(layers):
      parts += [nn.Dense(WIDTH), nn.relu]
    model = nn.Sequential(parts[:-1])
    variables = jax.tree_util.tree_map(fix, model.init(jax.random.key(0), x))
    return fl.unflaxify(model, variables, x), (model, variables)
  linears = [nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(i)) for i in range(layers)]
  for number, linear in enumerate(linears):
    linear.kernel.value = fix(linear.kernel.value)
    linear.bias.value = fix(jax.random.normal(jax.random.key(9 + number), (WIDTH,)))
  parts = []
  for linear in linears:
    parts += [linear, nnx.relu]
  model = nnx.Sequential(*parts[:-1])
  return fl.unflaxify(model, x), model


def _bytes(cache):
  return sum(np.asarray(v).nbytes for v in jax.tree_util.tree_leaves(cache))


def _budget_for(tree, x, examples):
  """A budget holding the captures of every call for `examples` examples, not more."""
  _, cache = fl.capture(tree, x[:1])
  return _bytes(cache) * examples + _bytes(cache) // 2


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("batch", [9, 8], ids=["last_chunk_overlaps", "equal_chunks"])
def test_budgeted_capture_of_every_call_equals_the_unbudgeted_capture(framework, batch):
  tree, _ = _stack(framework, layers=6)
  x = _inputs(batch)
  budget = _budget_for(tree, x, 3)
  expected = fl.capture(tree, x)
  assert _bytes(expected[1]) > budget  # the batch does not fit: it is split
  assert_trees_equal(fl.capture(tree, x, budget=budget), expected)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_budgeted_capture_with_real_weights_is_within_rounding_of_the_unbudgeted(framework):
  # Chunks are another program than the whole batch; measured on CPU: at most 3.8e-6.
  tree, _ = _stack(framework, exact=False, layers=6)
  x = _inputs(16, exact=False)
  out, cache = fl.capture(tree, x, budget=_budget_for(tree, x, 5))
  expected_out, expected = fl.capture(tree, x)
  assert sorted(cache) == sorted(expected)
  for site in expected:
    np.testing.assert_allclose(cache[site], expected[site], rtol=1e-5, atol=1e-5, err_msg=site)
  np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_budgeted_capture_equals_flax_own_capture(framework):
  tree, native = _stack(framework)
  x = _inputs(8)
  out, cache = fl.capture(
    tree, x, at=nn.Dense if framework is LINEN else nnx.Linear, budget=_budget_for(tree, x, 2)
  )
  if framework is LINEN:
    model, variables = native
    native_out, state = model.apply(
      variables, x, capture_intermediates=True, mutable=["intermediates"]
    )
    theirs = {
      name: values["__call__"][0]
      for name, values in state["intermediates"].items()
      if name != "__call__"
    }
  else:
    captured = nnx.capture(lambda m, v: m(v), nnx.Intermediate, method_outputs=nnx.Intermediate)
    native_out, state = captured(nnx.clone(native), x)
    theirs = {
      "/".join(map(str, path[:-1])): v.get_raw_value()[0]
      for path, v in nnx.to_flat_state(state)
      if len(path) > 1
    }
  assert_trees_equal(out, native_out)
  assert_trees_equal(cache, {name: theirs[name] for name in cache})


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("batch", [8, 7], ids=["equal_chunks", "last_chunk_overlaps"])
def test_chunks_of_one_size_share_one_compiled_program(framework, batch):
  tree, _ = _stack(framework, layers=3)
  x = _inputs(batch) + 0.25  # new values, so nothing is cached by value
  budget = _budget_for(tree, x, 2)  # 4 chunks of 2 examples
  with compilations() as compiled:
    fl.capture(tree, x, budget=budget)
  assert len(compiled) == 1


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_captures_within_the_budget_run_whole_and_come_back_on_the_host(framework):
  tree, _ = _stack(framework)
  x = _inputs(4)
  out, cache = fl.capture(tree, x, budget=10**9)
  expected_out, expected = fl.capture(tree, x)
  assert all(isinstance(v, np.ndarray) for v in jax.tree_util.tree_leaves((out, cache)))
  assert_trees_equal((out, cache), (expected_out, expected))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_interventions_that_broadcast_apply_to_every_chunk(framework):
  tree, _ = _stack(framework)
  x = _inputs(8)
  site = "layers_2" if framework is LINEN else "layers/2"
  edits = [fl.steer(site, jnp.full((WIDTH,), 0.5), alpha=2.0), fl.ablate(site, where=jnp.s_[:, 1])]
  expected = fl.capture(tree, x, interventions=edits)
  budgeted = fl.capture(tree, x, interventions=edits, budget=_budget_for(tree, x, 3))
  assert_trees_equal(budgeted, expected)


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_budget_below_one_example_is_refused_with_the_sizes_per_site(framework):
  tree, _ = _stack(framework)
  x = _inputs(4)
  with pytest.raises(fl.BudgetError, match=r"does not hold the captures of one example") as e:
    fl.capture(tree, x, budget=100)
  site = "layers_0" if framework is LINEN else "layers/0"
  assert f"{site}: 96" in str(e.value)  # (1, 3, 8) float32 per example
  assert "index=" in str(e.value) and "dtype=" in str(e.value)


CASES = {LINEN: "batchnorm_train", NNX: "convnet_train"}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_run_that_updates_state_is_not_split(corpora, framework):
  case = corpora[framework][CASES[framework]]
  tree = framework.convert(case)
  argument = framework.argument(case)
  _, cache = fl.capture(tree, argument, **framework.side_inputs(case))
  before = framework.tree_state(tree)
  with pytest.raises(
    fl.BudgetError, match=r"updates the state variables \[.*BatchStat|batch_stats"
  ):
    fl.capture(tree, argument, budget=_bytes(cache) - 1)
  assert_trees_equal(framework.tree_state(tree), before)


def test_a_linen_run_given_random_streams_is_not_split(corpora):
  """A Linen run given random streams is not split to fit `budget=`: each chunk would draw
  the random numbers that Flax draws once for the whole batch (NNX models keep their random
  state in variables, whose update refuses the split: the test above)."""
  case = corpora[LINEN]["dropout"]
  tree = LINEN.convert(case)
  argument = LINEN.argument(case)
  _, cache = fl.capture(tree, argument, random_streams=case.rngs)
  size = sum(np.asarray(v).nbytes for v in jax.tree_util.tree_leaves(cache))
  with pytest.raises(fl.BudgetError, match="every chunk of the batch would draw the same"):
    fl.capture(tree, argument, random_streams=case.rngs, budget=size - 1)


class _LinenTwo(nn.Module):
  @nn.compact
  def __call__(self, x, shift):
    return nn.Dense(WIDTH)(x) + shift


class _NNXTwo(nnx.Module):
  def __init__(self):
    self.dense = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))

  def __call__(self, x, shift):
    return self.dense(x) + shift


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_arguments_without_one_leading_size_are_named(framework):
  x, shift = _inputs(4), jnp.ones((WIDTH,))
  if framework is LINEN:
    model = _LinenTwo()
    tree = fl.unflaxify(model, model.init(jax.random.key(0), x, shift), x, shift)
  else:
    tree = fl.unflaxify(_NNXTwo(), x, shift)
  with pytest.raises(fl.BudgetError, match=r"args\[0\]: \(4, 3, 8\), args\[1\]: \(8,\)"):
    fl.capture(tree, (x, shift), budget=200)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_intervention_holding_the_whole_batch_is_refused(framework):
  tree, _ = _stack(framework)
  x = _inputs(8)
  site = "layers_2" if framework is LINEN else "layers/2"
  patch = fl.patch(site, jnp.zeros((8, 3, WIDTH)))
  with pytest.raises(fl.BudgetError, match=r"a run on one example fails: .*whole batch"):
    fl.capture(tree, x, interventions=[patch], budget=_budget_for(tree, x, 3))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_edit_selecting_examples_is_refused(framework):
  tree, _ = _stack(framework)
  x = _inputs(8)
  site = "layers_2" if framework is LINEN else "layers/2"
  with pytest.raises(fl.BudgetError, match=r"where= of fl.ablate\(.*selects along the leading"):
    fl.capture(
      tree, x, interventions=[fl.ablate(site, where=jnp.s_[0])], budget=_budget_for(tree, x, 3)
    )


class _LinenCentred(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH)(x)
    h = nn.Dense(WIDTH, name="centred")(h - h.mean(axis=0))  # couples the batch's examples
    return nn.Dense(WIDTH)(h)


class _NNXCentred(nnx.Module):
  def __init__(self):
    self.first = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
    self.centred = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(1))
    self.last = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(2))

  def __call__(self, x):
    h = self.first(x)
    return self.last(self.centred(h - h.mean(axis=0)))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_model_coupling_the_examples_is_refused_naming_the_first_site(framework):
  x = _inputs(8)
  if framework is LINEN:
    model = _LinenCentred()
    tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
  else:
    tree = fl.unflaxify(_NNXCentred(), x)
  with pytest.raises(fl.BudgetError, match=r"and centred of an example changes"):
    fl.capture(tree, x, budget=_budget_for(tree, x, 3))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(
  "options", [{"budget": 0}, {"budget": 1.5}, {"budget": 10, "jit": False}], ids=str
)
def test_a_budget_that_cannot_apply_is_refused(framework, options):
  tree, _ = _stack(framework)
  with pytest.raises(fl.BudgetError, match="budget="):
    fl.capture(tree, _inputs(4), **options)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_budget_without_captures_is_refused(framework):
  tree, _ = _stack(framework)
  with pytest.raises(fl.BudgetError, match="captures nothing"):
    fl.run(tree, _inputs(4), budget=10)
