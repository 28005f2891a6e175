"""The call dispatch both frameworks share: continuation, foreign trees, skipped and
removed calls, and checks of replacement outputs, each against native Flax; and the one
walk over a tree's calls (`core/_walk.py`) that every view of them is built on."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from replacements import PlusOne

import flaxlens as fl
from flaxlens.core._export import replaced_calls
from flaxlens.core._walk import own_call_nodes
from flaxlens.tools.base._sites import sites_of

from .models import X, scanned_tree


class LinenBlocks(nn.Module):
  """Up to four Dense blocks; how many run is chosen at call time."""

  dtype: object = None

  @nn.compact
  def __call__(self, x, n_blocks=3):
    for i in range(n_blocks):
      x = nn.Dense(4, dtype=self.dtype, name=f"blocks_{i}")(x)
    return x


class NNXBlocks(nnx.Module):
  """Up to four Linear blocks; how many run is chosen at call time."""

  def __init__(self, rngs, dtype=None):
    self.blocks = nnx.List([nnx.Linear(4, 4, dtype=dtype, rngs=rngs) for _ in range(4)])

  def __call__(self, x, n_blocks=3):
    for i in range(n_blocks):
      x = self.blocks[i](x)
    return x


class Linen:
  """Builds, converts and natively runs `LinenBlocks`; `patch` edits block outputs."""

  name = "linen"

  def __init__(self, seed, dtype=None):
    self.module = LinenBlocks(dtype)
    x = jnp.ones((2, 4))
    self.variables = self.module.init(jax.random.key(seed), x, n_blocks=4)

  def convert(self, x, n_blocks=3):
    return fl.unflaxify(self.module, self.variables, x, n_blocks=n_blocks)

  def key(self, i):
    return (i, f"blocks_{i}.__call__")

  def block(self, i, x):
    params = {"params": self.variables["params"][f"blocks_{i}"]}
    return nn.Dense(4, dtype=self.module.dtype).apply(params, x)

  def native(self, x, n_blocks=3, patch=None):
    patch = patch or {}

    def interceptor(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      name = context.module.name or ""
      if context.method_name == "__call__" and name.startswith("blocks_"):
        i = int(name.split("_")[1])
        if i in patch:
          return patch[i](args[0], out)
      return out

    with nn.intercept_methods(interceptor):
      return self.module.apply(self.variables, x, n_blocks=n_blocks)


class NNX:
  """Builds, converts and natively runs `NNXBlocks`; `patch` edits block outputs."""

  name = "nnx"

  def __init__(self, seed, dtype=None):
    self.model = NNXBlocks(nnx.Rngs(seed), dtype)

  def convert(self, x, n_blocks=3):
    return fl.unflaxify(self.model, x, n_blocks=n_blocks)

  def key(self, i):
    return (i, f"blocks/{i}.__call__")

  def block(self, i, x):
    return self.model.blocks[i](x)

  def native(self, x, n_blocks=3, patch=None):
    patch = patch or {}
    for i in range(n_blocks):
      out = self.model.blocks[i](x)
      x = patch[i](x, out) if i in patch else out
    return x


@pytest.fixture(params=[Linen, NNX], ids=["linen", "nnx"])
def fw(request):
  return request.param


def run(tree, x, n_blocks=3):
  return tree(fl.ArgsAndKwargs.capture(x, n_blocks=n_blocks))


def replace(tree, key, layer):
  return tree.select().at(lambda t: t.submodule_calls[key]).set(layer)


class CallOther(fl.Layer):
  """Runs another layer (a node of this tree or of another one) in place of the call."""

  other: object

  def __call__(self, argument, /, **side_inputs):
    return self.other(argument).astype(argument.args[0].dtype)


class PlusOther(fl.Layer):
  """Continues the call and adds the output of another layer on the same argument."""

  inner: object
  other: object

  def __call__(self, argument, /, **side_inputs):
    return self.inner(argument) + self.other(argument)


class PlusWholeTree(fl.Layer):
  """Continues the call and adds the output of a whole other tree on the same input."""

  inner: object
  tree: object

  def __call__(self, argument, /, **side_inputs):
    x = argument.args[0]
    return self.inner(argument) + self.tree(fl.ArgsAndKwargs.capture(x, n_blocks=3))


class Returns(fl.Layer):
  """Continues the call, then returns `fn(output)`."""

  inner: object
  fn: object = fl.static_field()

  def __call__(self, argument, /, **side_inputs):
    return self.fn(self.inner(argument))


# --- continuation and foreign nodes ------------------------------------------------------


def test_wrapping_node_continues_the_replaced_call(fw):
  host = fw(0)
  tree = host.convert(X)
  patched = replace(tree, host.key(1), PlusOne(tree.submodule_calls[host.key(1)]))
  expected = host.native(X, patch={1: lambda x, out: out + 1.0})
  assert_trees_equal(run(patched, X), expected)


def test_a_node_of_another_tree_runs_with_its_own_parameters(fw):
  host, teacher = fw(0), fw(1)
  teacher_node = teacher.convert(X).submodule_calls[teacher.key(1)]
  patched = replace(host.convert(X), host.key(1), CallOther(teacher_node))
  expected = host.native(X, patch={1: lambda x, out: teacher.block(1, x)})
  assert_trees_equal(run(patched, X), expected)


def test_a_node_of_another_tree_with_other_settings_runs_its_own_module(fw):
  host, teacher = fw(0), fw(1, dtype=jnp.bfloat16)
  teacher_node = teacher.convert(X).submodule_calls[teacher.key(1)]
  patched = replace(host.convert(X), host.key(1), CallOther(teacher_node))
  expected = host.native(X, patch={1: lambda x, out: teacher.block(1, x).astype(x.dtype)})
  assert_trees_equal(run(patched, X), expected)


def test_a_node_of_another_tree_beside_the_wrapped_node_keeps_both_parameters(fw):
  host, teacher = fw(0), fw(1)
  tree = host.convert(X)
  teacher_node = teacher.convert(X).submodule_calls[teacher.key(1)]
  patched = replace(tree, host.key(1), PlusOther(tree.submodule_calls[host.key(1)], teacher_node))
  expected = host.native(X, patch={1: lambda x, out: out + teacher.block(1, x)})
  assert_trees_equal(run(patched, X), expected)


def test_a_whole_other_tree_inside_a_replacement_gives_its_own_output(fw):
  host, teacher = fw(0), fw(1)
  tree = host.convert(X)
  layer = PlusWholeTree(tree.submodule_calls[host.key(0)], teacher.convert(X))
  patched = replace(tree, host.key(0), layer)
  teacher_output = teacher.native(X)  # Block 0's input is X.
  expected = host.native(X, patch={0: lambda x, out: out + teacher_output})
  assert_trees_equal(run(patched, X), expected)


def test_a_node_of_another_call_of_the_same_tree_runs_as_its_own_tree(fw):
  host = fw(0)
  tree = host.convert(X)
  patched = replace(tree, host.key(0), CallOther(tree.submodule_calls[host.key(2)]))
  expected = host.native(X, patch={0: lambda x, out: host.block(2, x)})
  assert_trees_equal(run(patched, X), expected)


def test_a_node_of_another_tree_set_directly_replaces_the_call(fw):
  host, teacher = fw(0), fw(1)
  teacher_node = teacher.convert(X).submodule_calls[teacher.key(2)]
  patched = replace(host.convert(X), host.key(2), teacher_node)
  expected = host.native(X, patch={2: lambda x, out: teacher.block(2, x)})
  assert_trees_equal(run(patched, X), expected)


def test_the_views_of_a_tree_calls_agree_on_wrapped_foreign_and_own_calls(fw):
  host, teacher = fw(0), fw(1)
  tree = host.convert(X)
  own = [tree.submodule_calls[host.key(i)] for i in range(3)]
  teacher_node = teacher.convert(X).submodule_calls[teacher.key(1)]
  patched = replace(tree, host.key(0), PlusOne(own[0]))  # wrapped: the call continues
  patched = replace(patched, host.key(1), CallOther(teacher_node))  # another tree's node
  nodes = list(own_call_nodes(patched))
  sites = sites_of(patched)
  names = [host.key(i)[1].removesuffix(".__call__") for i in range(3)]
  assert [id(n) for n in nodes] == [id(patched), id(own[0]), id(own[2])]
  # The foreign node runs as a tree of its own, nested in the replaced call: a site named
  # under that call, after the own calls made before it.
  assert [id(s.node) for s in sites] == [id(nodes[0]), id(nodes[1]), id(teacher_node), id(nodes[2])]
  nested = f"{names[1]}/{teacher_node.module_type.__name__}"
  assert [s.name for s in sites[1:]] == [names[0], nested, names[2]]
  assert replaced_calls(patched) == [host.key(0)[1], host.key(1)[1]]
  # What the run does: the wrapped call and the own one run with the host's
  # parameters, the foreign node with the teacher's; captured as Flax computes them.
  first = host.block(0, X)
  second = teacher.block(1, first + 1.0)
  out, cache = fl.capture(patched, fl.ArgsAndKwargs.capture(X, n_blocks=3))
  assert sorted(cache) == sorted(s.name for s in sites)
  assert_trees_equal(cache[names[0]], first)
  assert_trees_equal(cache[names[2]], host.block(2, second))
  assert_trees_equal(
    out, host.native(X, patch={0: lambda x, o: o + 1.0, 1: lambda x, o: teacher.block(1, x)})
  )


# --- calls the caller skips ----------------------------------------------------------------


def test_a_replaced_call_the_caller_skips_is_an_error(fw):
  host = fw(0)
  tree = host.convert(X, n_blocks=3)
  patched = replace(tree, host.key(2), PlusOne(tree.submodule_calls[host.key(2)]))
  with pytest.raises(fl.CallStructureError, match=r"call \(2, 'blocks.2.__call__'\) is replaced"):
    run(patched, X, n_blocks=2)


def test_a_call_holding_a_replaced_call_the_caller_skips_is_an_error():
  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x, n_blocks=3):
      return LinenBlocks(name="inner")(x, n_blocks=n_blocks)

  module = Outer()
  variables = module.init(jax.random.key(0), X, n_blocks=4)
  tree = fl.unflaxify(module, variables, X, n_blocks=3)
  patched = tree.select().at_path("inner/blocks_2").apply(PlusOne)
  with pytest.raises(fl.CallStructureError, match=r"call \(2, 'blocks_2.__call__'\) is replaced"):
    run(patched, X, n_blocks=2)


def test_unreplaced_calls_the_caller_skips_run_natively(fw):
  host = fw(0)
  tree = host.convert(X, n_blocks=3)
  patched = replace(tree, host.key(0), PlusOne(tree.submodule_calls[host.key(0)]))
  expected = host.native(X, n_blocks=2, patch={0: lambda x, out: out + 1.0})
  assert_trees_equal(run(patched, X, n_blocks=2), expected)


def test_a_replaced_call_beyond_those_converted_is_an_error(fw):
  host = fw(0)
  tree = host.convert(X, n_blocks=3)
  patched = replace(tree, host.key(1), PlusOne(tree.submodule_calls[host.key(1)]))
  with pytest.raises(fl.CallStructureError, match=r"call \(3, 'blocks.3.__call__'\) was not made"):
    run(patched, X, n_blocks=4)


# --- removed and non-callable entries ----------------------------------------------------


def test_a_removed_call_is_an_error_saying_to_replace_it(fw):
  host = fw(0)
  patched = replace(host.convert(X), host.key(1), None)
  with pytest.raises(
    fl.ReplacementError, match=r"call \(1, .*removed.*replace it with an fl.Layer"
  ):
    run(patched, X)


def test_a_call_deleted_from_submodule_calls_is_an_error(fw):
  host = fw(0)
  patched = (
    host.convert(X).select().at(lambda t: t.submodule_calls[host.key(1)]).remove_from_parent()
  )
  with pytest.raises(
    fl.ReplacementError, match=r"call \(1, .*removed.*replace it with an fl.Layer"
  ):
    run(patched, X)


def test_a_non_callable_entry_is_an_error_naming_the_call(fw):
  host = fw(0)
  patched = replace(host.convert(X), host.key(1), jnp.zeros((2, 4)))
  with pytest.raises(fl.ReplacementError, match=r"call \(1, .* is a ArrayImpl, which cannot run"):
    run(patched, X)


# --- replacement outputs -----------------------------------------------------------------


def _wrap(tree, key, fn):
  return replace(tree, key, Returns(tree.submodule_calls[key], fn))


def test_a_replacement_output_of_the_wrong_shape_is_an_error(fw):
  host = fw(0)
  patched = _wrap(host.convert(X), host.key(1), lambda out: jnp.zeros((2, 5)))
  with pytest.raises(fl.ReplacementError, match=r"call \(1, .*float32\[2, 5\].*float32\[2, 4\]"):
    run(patched, X)


def test_a_replacement_returning_a_one_tuple_is_an_error(fw):
  host = fw(0)
  patched = _wrap(host.convert(X), host.key(1), lambda out: (out,))
  with pytest.raises(
    fl.ReplacementError, match=r"Returns returned \(float32\[2, 4\],\).*structure"
  ):
    run(patched, X)


def test_a_replacement_output_of_the_wrong_dtype_is_an_error(fw):
  host = fw(0)
  patched = _wrap(host.convert(X), host.key(1), lambda out: out.astype(jnp.bfloat16))
  with pytest.raises(fl.ReplacementError, match=r"bfloat16\[2, 4\].*float32\[2, 4\]"):
    run(patched, X)


def test_a_replacement_output_of_the_wrong_rank_for_another_batch_is_an_error(fw):
  host = fw(0)
  patched = _wrap(host.convert(X), host.key(1), lambda out: out[None])
  with pytest.raises(fl.ReplacementError, match=r"float32\[1, 3, 4\]"):
    run(patched, jnp.ones((3, 4)))


def test_a_right_replacement_output_for_another_batch_size_runs(fw):
  host = fw(0)
  x = jnp.arange(12.0).reshape(3, 4)
  patched = _wrap(host.convert(X), host.key(1), lambda out: out * 2.0)
  expected = host.native(x, patch={1: lambda _, out: out * 2.0})
  assert_trees_equal(run(patched, x), expected)


@pytest.mark.parametrize("name", ["linen", "nnx"])
def test_a_replacement_inside_a_scan_body_is_checked_per_iteration(name):
  tree, path = scanned_tree(name)
  wrong = tree.select().at_path(path).apply(lambda n: Returns(n, lambda o: o[:, :2]))
  with pytest.raises(fl.ReplacementError, match=r"float32\[2, 2\].*float32\[2, 4\]"):
    wrong(fl.ArgsAndKwargs.capture(X))


# --- arguments ---------------------------------------------------------------------------


def test_args_and_kwargs_refuses_an_array_as_the_argument_tuple():
  with pytest.raises(fl.ArgumentError, match=r"ArgsAndKwargs.capture\(\*args, \*\*kwargs\)"):
    fl.ArgsAndKwargs(X, {})


def test_args_and_kwargs_refuses_a_list_of_keyword_arguments():
  with pytest.raises(fl.ArgumentError, match="a tuple and a list"):
    fl.ArgsAndKwargs((X,), [])


def test_args_and_kwargs_survives_jax_tree_maps():
  argument = fl.ArgsAndKwargs.capture(X, scale=2.0)
  doubled = jax.tree_util.tree_map(lambda a: a * 2, argument)
  assert_trees_equal(doubled.args[0], X * 2)
  assert doubled.kwargs == {"scale": 4.0}


def test_changing_nnx_attributes_leaves_a_node_of_another_tree_as_it_is():
  host, teacher = NNX(0), NNX(1, dtype=jnp.bfloat16)
  teacher_node = teacher.convert(X).submodule_calls[teacher.key(1)]
  patched = replace(host.convert(X), host.key(1), CallOther(teacher_node)).eval()
  expected = host.native(X, patch={1: lambda x, out: teacher.block(1, x).astype(x.dtype)})
  assert_trees_equal(run(patched, X), expected)


def test_two_trees_of_one_architecture_share_labels_until_one_is_relabelled(fw):
  host, teacher = fw(0), fw(1)
  tree = host.convert(X)
  teacher_node = teacher.convert(X).submodule_calls[teacher.key(1)]
  patched = replace(tree, host.key(1), PlusOther(tree.submodule_calls[host.key(1)], teacher_node))
  with pytest.raises(fl.VariableError, match="fl.relabel_variables"):
    fl.variable_jit(run)(patched, X)


def test_a_relabelled_tree_inside_a_replacement_runs_under_variable_jit(fw):
  host, teacher = fw(0), fw(1)
  tree = host.convert(X)
  teacher_node = fl.relabel_variables(teacher.convert(X), "teacher/").submodule_calls[
    teacher.key(1)
  ]
  patched = replace(tree, host.key(1), PlusOther(tree.submodule_calls[host.key(1)], teacher_node))
  expected = jax.jit(lambda x: host.native(x, patch={1: lambda x, out: out + teacher.block(1, x)}))
  assert_trees_equal(fl.variable_jit(run)(patched, X), expected(X))


def test_a_weakly_typed_replacement_output_runs(fw):
  host = fw(0, dtype=jnp.bfloat16)
  patched = _wrap(host.convert(X), host.key(1), lambda out: jnp.full(out.shape, 0.5))
  expected = host.native(X, patch={1: lambda _, out: jnp.full(out.shape, 0.5)})
  assert_trees_equal(run(patched, X), expected)
