"""The `part=` rule in every tool that takes a site, on a call returning a tuple.

The model's `block` returns `(hidden, normed)`, as a Hugging Face block returns
`(hidden_states, ...)`; `part=0` picks the hidden state. Each tool's result is compared
with the same edit or read written natively, piece by piece from the Flax submodules
(`Structured.native`). The block also calls a method of its own (`norm`), so the path
`"block"` names two calls (`block` and `block.norm`) and `"block.__call__"` names its call.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import LINEN, NNX

import flaxlens as fl

FRAMEWORKS = [LINEN, NNX]
X = jax.random.normal(jax.random.key(1), (2, 5, 4))
VECTOR = jnp.linspace(-1.0, 1.0, 4)
BLOCK = "block.__call__"  # the block's call alone, not its method `norm`


def _norm(x):
  return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1.0)


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    normed = self.norm(x)
    return x + nn.Dense(4, name="write")(normed), normed

  def norm(self, x):
    return _norm(x)


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    hidden, normed = LinenBlock(name="block")(x)
    return nn.Dense(3, name="out")(hidden) + normed.sum(-1, keepdims=True)


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.write = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    normed = self.norm(x)
    return x + self.write(normed), normed

  def norm(self, x):
    return _norm(x)


class NNXModel(nnx.Module):
  def __init__(self, rngs):
    self.block = NNXBlock(rngs)
    self.out = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    hidden, normed = self.block(x)
    return self.out(hidden) + normed.sum(-1, keepdims=True)


class Structured:
  """The model of a framework, its tree, and its pieces called natively."""

  def __init__(self, fw):
    self.fw = fw
    if fw is LINEN:
      self.model = LinenModel()
      self.variables = self.model.init(jax.random.key(0), X)
      self.tree = fl.unflaxify(self.model, self.variables, X)
      self.sae = nn.Dense(4)
      self.sae_variables = self.sae.init(jax.random.key(2), X)
    else:
      self.model = NNXModel(nnx.Rngs(0))
      self.tree = fl.unflaxify(self.model, X)
      self.sae, self.sae_variables = nnx.Linear(4, 4, rngs=nnx.Rngs(2)), None

  def block(self, x):
    if self.fw is LINEN:
      return LinenBlock().apply({"params": self.variables["params"]["block"]}, x)
    return self.model.block(x)

  def native(self, x, hidden=lambda h: h):
    """The model natively, `hidden` applied to the block's first output."""
    h, normed = self.block(x)
    if self.fw is LINEN:
      out = nn.Dense(3).apply({"params": self.variables["params"]["out"]}, hidden(h))
    else:
      out = self.model.out(hidden(h))
    return out + normed.sum(-1, keepdims=True)

  def sae_native(self, x):
    if self.fw is LINEN:
      return self.sae.apply(self.sae_variables, x)
    return self.sae(x)

  def splice(self, at, tree=None, **options):
    """`fl.splice` of this SAE into `tree` (default: the model's tree)."""
    extra = () if self.sae_variables is None else (self.sae_variables,)
    return fl.splice(self.tree if tree is None else tree, at, self.sae, *extra, **options)

  def exported(self, tree, x):
    """`tree`'s export run natively."""
    if self.fw is LINEN:
      return self.model.apply(self.fw.export(tree), x)
    return self.fw.export(tree)(x)


@pytest.fixture(params=FRAMEWORKS)
def structured(request):
  return Structured(request.param)


def test_steering_a_part_of_a_tuple_output_equals_steering_it_natively(structured):
  steered = fl.run(structured.tree, X, interventions=[fl.steer(BLOCK, VECTOR, 2.0, part=0)])
  native = jax.jit(lambda x: structured.native(x, lambda h: h + jnp.float32(2.0) * VECTOR))
  assert_trees_equal(steered, native(X))


def test_harvest_stores_the_part_of_a_tuple_output(structured, tmp_path):
  stored = fl.harvest(structured.tree, [X], BLOCK, str(tmp_path / "acts"), part=0)
  hidden, _ = jax.jit(structured.block)(X)
  assert_trees_equal(stored["block"][:], np.asarray(hidden).reshape(-1, 4))


def test_harvest_takes_a_part_per_site(structured, tmp_path):
  stored = fl.harvest(
    structured.tree,
    [X],
    [BLOCK, "block/write"],
    str(tmp_path / "acts"),
    part={"block": 1, "**": None},
  )
  _, normed = jax.jit(structured.block)(X)
  assert_trees_equal(stored["block"][:], np.asarray(normed).reshape(-1, 4))


def test_a_harvest_of_another_part_does_not_resume_a_store(structured, tmp_path):
  path = str(tmp_path / "acts")
  fl.harvest(structured.tree, [X], BLOCK, path, part=0)
  with pytest.raises(fl.HarvestError, match="What differs: sites"):
    fl.harvest(structured.tree, [X], BLOCK, path, part=1)


def test_splice_replaces_the_part_of_a_tuple_output(structured):
  spliced = structured.splice(BLOCK, part=0, error=False)
  native = jax.jit(lambda x: structured.native(x, structured.sae_native))
  assert_trees_equal(fl.run(spliced, X), native(X))


def test_splice_of_a_part_with_its_error_term_leaves_the_output_unchanged(structured):
  spliced = structured.splice(BLOCK, part=0)
  assert_trees_equal(fl.run(spliced, X), jax.jit(structured.native)(X))


def test_fold_moves_steering_of_a_part_onto_the_call_that_writes_it(structured):
  steer = fl.steer(BLOCK, VECTOR, 2.0, part=0)
  folded = fl.fold(structured.tree, X, [steer])
  bias = {
    tree: tree.select().at_path("block/write").get_sequence()[0].scope_data.parameters["bias"]
    for tree in (structured.tree, folded)
  }
  added = jax.tree_util.tree_leaves(bias[structured.tree].value)[0] + jnp.float32(2.0) * VECTOR
  assert_trees_equal(jax.tree_util.tree_leaves(bias[folded].value)[0], added)
  native = structured.native(X, lambda h: h + jnp.float32(2.0) * VECTOR)
  np.testing.assert_allclose(structured.exported(folded, X), native, atol=1e-5, rtol=1e-5)


def test_a_module_path_naming_several_methods_says_so_and_gives_the_call_form(structured):
  message = (
    r"block\.norm: part=0, but the output is one array .* The site 'block' is a module path"
    r" without a method, so it names every method of that module that ran: \['block',"
    r" 'block\.norm'\]\. Give 'block\.__call__' to name its call alone\."
  )
  with pytest.raises(fl.ArgumentError, match=message):
    fl.run(structured.tree, X, interventions=[fl.steer("block", VECTOR, part=0)])


def _metric(out):
  return out.sum()


TOOLS = {
  "run": lambda tree, at: fl.run(tree, X, interventions=[fl.steer(at, VECTOR)]),
  "sweep": lambda tree, at: fl.sweep(tree, X, 2 * X, at, _metric),
  "attribute": lambda tree, at: fl.attribute(tree, X, 2 * X, at, _metric),
  "grad_at": lambda tree, at: fl.grad_at(tree, X, at, _metric),
  "lens": lambda tree, at: fl.lens(tree, X, at, head=lambda h: h),
  "path_patch": lambda tree, at: fl.path_patch(tree, X, 2 * X, "block/write", at, _metric),
}


@pytest.mark.parametrize("tool", [*TOOLS, "harvest", "splice"])
def test_every_tool_refuses_a_tuple_output_without_part_in_one_text(structured, tool, tmp_path):
  expected = (
    "block: the output is a tuple (float32[2, 5, 4], float32[2, 5, 4]), not one array. Pass"
    " part= to choose the array (part=0: the first entry, as Hugging Face blocks return"
    " (hidden_states, ...)); fl.path_patch takes it as fl.Sites(at, part=...)"
    ' (docs/interventions.md, "Structured values: part=").'
  )
  with pytest.raises(fl.ArgumentError) as refused:
    if tool == "harvest":
      fl.harvest(structured.tree, [X], BLOCK, str(tmp_path / "acts"))
    elif tool == "splice":
      structured.splice(BLOCK)
    else:
      TOOLS[tool](structured.tree, BLOCK)
  assert str(refused.value) == expected


class LinenArrayBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(4, name="write")(self.norm(x))

  def norm(self, x):
    return _norm(x)


class LinenArrayModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, name="out")(LinenArrayBlock(name="block")(x))


class NNXArrayBlock(NNXBlock):
  def __call__(self, x):
    return x + self.write(self.norm(x))


class NNXArrayModel(NNXModel):
  def __init__(self, rngs):
    self.block = NNXArrayBlock(rngs)
    self.out = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(self.block(x))


def test_splicing_a_modules_call_leaves_its_other_methods_alone(structured):
  """`fl.splice(tree, "block.__call__", ...)` replaces the block's output only, not also
  the output of `block.norm` (the site name of a `__call__`, `"block"`, names both)."""
  if structured.fw is LINEN:
    model = LinenArrayModel()
    variables = model.init(jax.random.key(0), X)
    tree = fl.unflaxify(model, variables, X)
    params = variables["params"]

    def block(x):
      return LinenArrayBlock().apply({"params": params["block"]}, x)

    def out(h):
      return nn.Dense(3).apply({"params": params["out"]}, h)

  else:
    model = NNXArrayModel(nnx.Rngs(0))
    tree, block, out = fl.unflaxify(model, X), model.block, model.out
  spliced = structured.splice(BLOCK, error=False, tree=tree)
  native = jax.jit(lambda x: out(structured.sae_native(block(x))))
  assert_trees_equal(fl.run(spliced, X), native(X))


class Hidden(NamedTuple):
  hidden: jax.Array
  normed: jax.Array


class LinenNamedBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    normed = _norm(x)
    return Hidden(x + nn.Dense(4, name="write")(normed), normed)


class LinenNamedModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return LinenNamedBlock(name="block")(x).hidden


class NNXNamedBlock(NNXBlock):
  def __call__(self, x):
    normed = _norm(x)
    return Hidden(x + self.write(normed), normed)


class NNXNamedModel(nnx.Module):
  def __init__(self, rngs):
    self.block = NNXNamedBlock(rngs)

  def __call__(self, x):
    return self.block(x).hidden


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_named_tuples_field_is_a_part(fw):
  if fw is LINEN:
    model = LinenNamedModel()
    tree = fl.unflaxify(model, model.init(jax.random.key(0), X), X)
  else:
    model = NNXNamedModel(nnx.Rngs(0))
    tree = fl.unflaxify(model, X)
  by_field = fl.run(tree, X, interventions=[fl.steer("block", VECTOR, 2.0, part="hidden")])
  by_index = fl.run(tree, X, interventions=[fl.steer("block", VECTOR, 2.0, part=0)])
  assert_trees_equal(by_field, by_index)
