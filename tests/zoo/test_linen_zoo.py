"""Third-party Linen models (random weights): exact conversion, patching and editing."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal

import flaxlens as fl

pytestmark = pytest.mark.slow

MODELS = ["griffin", "gpt2", "resnet18"]
# One call deep inside each model, replaced by zeros in the patching test.
PATCH_PATHS = {
  "griffin": "blocks.1/mlp_block",
  "gpt2": "transformer/h/1/attn",
  "resnet18": "BasicBlock_3/Conv_1",
}


def _output(model, result):
  return result[0] if model.mutable else result


@pytest.mark.parametrize("name", MODELS)
def test_converted_model_matches_apply_bit_for_bit(request, name):
  model = request.getfixturevalue(name)
  tree = model.convert()
  assert_trees_equal(model.call(tree), _output(model, model.apply()))


def test_resnet_batch_stats_update_like_apply(resnet18):
  tree = resnet18.convert()
  resnet18.call(tree)
  _, updates = resnet18.apply()
  (mean,) = [
    v for v in fl.variables_in(tree) if v.label == "batch_stats:BasicBlock_7/BatchNorm_1/mean"
  ]
  assert_trees_equal(mean.value, updates["batch_stats"]["BasicBlock_7"]["BatchNorm_1"]["mean"])


class Zeros(fl.Layer):
  shape_dtype: object = fl.static_field()

  def __call__(self, argument, /, **side_inputs):
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.shape_dtype)


@pytest.mark.parametrize("name", MODELS)
def test_replacing_a_deep_call_matches_flax_with_that_call_replaced(request, name):
  model = request.getfixturevalue(name)
  path = tuple(PATCH_PATHS[name].split("/"))
  outputs = {}

  def zero_it(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and context.module.path == path:
      outputs["shape"] = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out
      )
      return jax.tree_util.tree_map(jnp.zeros_like, out)
    return out

  with nn.intercept_methods(zero_it):
    expected = _output(model, model.apply())
  tree = model.convert()
  patched = tree.select().at_path(PATCH_PATHS[name]).apply(lambda _: Zeros(outputs["shape"]))
  assert_trees_equal(model.call(patched), expected)


def test_editing_a_griffin_parameter_matches_apply_with_the_edit(griffin):
  tree = griffin.convert()
  norm = tree.select().at_path("final_norm").get()
  scale = norm.scope_data.parameters["scale"]
  scale.value = scale.value + 0.5
  edited = {"params": {**griffin.variables["params"], "final_norm": {"scale": scale.value}}}
  assert_trees_equal(griffin.call(tree), griffin.apply(variables=edited))


@pytest.mark.parametrize("name", MODELS)
def test_export_without_edits_gives_back_the_variables_exactly(request, name):
  model = request.getfixturevalue(name)
  exported = model.convert().export()
  leaves, treedef = jax.tree_util.tree_flatten(exported)
  original, original_treedef = jax.tree_util.tree_flatten(model.variables)
  assert treedef == original_treedef
  assert all(a is b for a, b in zip(leaves, original, strict=True))


@pytest.mark.parametrize("name", MODELS)
def test_edited_parameters_export_to_variables_apply_computes_as_the_tree(request, name):
  model = request.getfixturevalue(name)
  tree = model.convert()
  for p in fl.variables_in(tree):
    if isinstance(p, fl.Parameter):
      p.value = p.value * 1.25
  expected = _output(model, model.apply(variables=tree.export()))
  assert_trees_equal(model.call(tree), expected)


# Token ids GPT-2 cannot take: without a batch axis, or more than its 32 positions.
GPT2_BAD_IDS = {
  "no_batch_axis": lambda ids: ids[0],
  "longer_than_its_positions": lambda ids: jnp.tile(ids, (1, 5)),
}


@pytest.mark.parametrize("bad", list(GPT2_BAD_IDS))
def test_gpt2_ids_it_cannot_take_raise_its_own_error_naming_the_shapes(gpt2, bad):
  ids = GPT2_BAD_IDS[bad](gpt2.args[0])
  args = (ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape))
  with pytest.raises(Exception) as native:
    gpt2.module.apply(gpt2.variables, *args, rngs=gpt2.rngs, **gpt2.kwargs)
  tree = gpt2.convert()
  with pytest.raises(fl.ModelCallError) as ours:
    tree(fl.ArgsAndKwargs.capture(*args, **gpt2.kwargs), random_streams=gpt2.rngs)
  assert isinstance(ours.value, type(native.value))
  assert type(ours.value.__cause__) is type(native.value)
  assert str(ours.value.__cause__) == str(native.value)
  shown = ", ".join([f"int32{list(ids.shape)}"] * 3)
  assert f"got ({shown}, deterministic=False); at conversion it got (" in str(ours.value)
  assert "int32[2, 8], int32[2, 8], int32[2, 8], deterministic=False)" in str(ours.value)


def test_gpt2_heads_on_the_attention_output_projections_output_are_refused(gpt2):
  # c_proj merges GPT-2's n_head=2 heads: its output holds none. The refusal shows the
  # form that names them, on its input, which equals zeroing head 1's columns natively.
  inputs = gpt2.args
  variables = gpt2.variables
  tree = fl.unflaxify(gpt2.module, variables, *inputs, deterministic=True)
  path = "transformer/h/0/attn/c_proj"
  shown = rf"fl\.heads\('{path}', \[1\], on='input'\)"
  with pytest.raises(fl.HeadsError, match=rf"^{path}: .*holds no heads.*{shown}"):
    fl.run(tree, inputs, interventions=[fl.ablate(fl.heads(path, 1))])

  def zero_head_1(next_fun, args, kwargs, context):
    if context.module.path == tuple(path.split("/")):
      return next_fun(args[0].at[..., 16:32].set(0.0), *args[1:], **kwargs)
    return next_fun(*args, **kwargs)

  def native(variables, *inputs):
    with nn.intercept_methods(zero_head_1):
      return gpt2.module.apply(variables, *inputs, deterministic=True)

  edit = fl.ablate(fl.heads(path, [1], on="input"))
  out = fl.run(tree, fl.ArgsAndKwargs.capture(*inputs, deterministic=True), interventions=[edit])
  assert_trees_equal(out.logits, jax.jit(native)(variables, *inputs).logits)
