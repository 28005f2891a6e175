"""A call of a tree that fails inside the model's own code raises `fl.ModelCallError`.

The corpus model `positional` embeds token ids `(batch, length)` with positions from a
table of 8 rows, as GPT-2 does: 1-D ids fail in the root's own code (`tokens.shape[1]`),
more than 8 positions fail inside the call adding the table (a broadcasting error). Each
failure is compared with the same call of the native model: the tree raises the native
error as a `ModelCallError` that is also of the native error's class, whose cause is the
native error, and whose message names the calls and the shapes they had at conversion
and now. Arguments of new shapes that the model accepts run as natively. An error raised
by a function given to `fl.modify` is the function's, not the model's: its message names
`fl.modify` and the site (not the model's code), and it is still of the function's error
class, from the function's own error.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX
from replacements import PlusOne

import flaxlens as fl

FRAMEWORKS = [LINEN, NNX]
CONVERTED = "int32[2, 4]"  # The corpus's TOKENS, as conversion saw them.
TABLE_CALL = {LINEN.name: "PositionTable_0.__call__", NNX.name: "positions.__call__"}


class Raises(fl.Layer):
  """A replacement layer with a bug of its own."""

  def __call__(self, argument, /, **side_inputs):
    raise RuntimeError("a bug in my layer")


class WrongShape(fl.Layer):
  """A replacement returning what the call cannot return."""

  def __call__(self, argument, /, **side_inputs):
    return jnp.zeros((3,))


def _tree_call(tree, tokens, jit):
  if jit:
    return fl.variable_jit(lambda t, x: t(fl.ArgsAndKwargs.capture(x)))(tree, tokens)
  return tree(fl.ArgsAndKwargs.capture(tokens))


def _native_error(fw, case, tokens, jit):
  native = fw.native_function(case)
  with pytest.raises(Exception) as raised:
    (jax.jit(native) if jit else native)(tokens)
  return raised.value


def _tree_error(fw, case, tokens, jit, tree=None):
  tree = fw.convert(case) if tree is None else tree
  with pytest.raises(fl.ModelCallError) as raised:
    _tree_call(tree, tokens, jit)
  return tree, raised.value


def _same_error(ours, native):
  assert isinstance(ours, type(native)), type(ours).__mro__
  assert type(ours.__cause__) is type(native)
  assert str(ours.__cause__) == str(native)


def _positional(corpora, fw):
  return corpora[fw]["positional"]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_token_ids_of_another_rank_raise_the_native_error_naming_the_shapes(corpora, fw, jit):
  case = _positional(corpora, fw)
  tokens = case.args[0][0]
  native = _native_error(fw, case, tokens, jit)
  tree, ours = _tree_error(fw, case, tokens, jit)
  _same_error(ours, native)
  message = str(ours)
  assert message.startswith(f"{tree.where()}: this call failed inside the model's own code (")
  assert f"got (int32[4]); at conversion it got ({CONVERTED})" in message
  assert message.endswith("convert it with example arguments like these.")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_more_positions_than_the_table_holds_name_the_call_that_failed(corpora, fw, jit):
  case = _positional(corpora, fw)
  tokens = jnp.ones((2, 12), jnp.int32)
  native = _native_error(fw, case, tokens, jit)
  _, ours = _tree_error(fw, case, tokens, jit)
  _same_error(ours, native)
  message = str(ours)
  table = TABLE_CALL[fw.name]
  assert f"own code, in {table} (" in message
  assert f"got (int32[2, 12]); at conversion it got ({CONVERTED})" in message
  assert f"{table} got (float32[2, 12, 8], 12); at conversion it got (float32[2, 4, 8], 4)" in (
    message
  )


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_new_argument_shapes_the_model_accepts_run_as_natively(corpora, fw):
  case = _positional(corpora, fw)
  tokens = jnp.arange(18, dtype=jnp.int32).reshape(3, 6) % 10
  tree = fw.convert(case)
  expected = fw.native_function(case)(tokens)
  assert_trees_equal(_tree_call(tree, tokens, jit=False), expected)
  assert_trees_equal(_tree_call(tree, tokens, jit=True), jax.jit(fw.native_function(case))(tokens))


def _replaced(fw, case, layer):
  tree = fw.convert(case)
  node = tree.select().at_path(TABLE_CALL[fw.name].removesuffix(".__call__")).get()
  return tree.select().at_path(TABLE_CALL[fw.name].removesuffix(".__call__")).set(layer(node))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_error_of_a_replacement_layer_passes_unchanged(corpora, fw):
  case = _positional(corpora, fw)
  tree = _replaced(fw, case, lambda node: Raises())
  with pytest.raises(RuntimeError, match="a bug in my layer") as raised:
    _tree_call(tree, case.args[0], jit=False)
  assert type(raised.value) is RuntimeError


def _buggy_edit(argument, value):
  raise RuntimeError("a bug in my edit")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_error_of_an_intervention_function_names_fl_modify_and_the_site(corpora, fw, jit):
  case = _positional(corpora, fw)
  site = TABLE_CALL[fw.name].removesuffix(".__call__")
  edit = fl.modify(site, _buggy_edit)
  with pytest.raises(RuntimeError) as raised:
    fl.run(fw.convert(case), case.args[0], interventions=[edit], jit=jit)
  message = str(raised.value)
  assert isinstance(raised.value, fl.FlaxlensError)
  assert message.startswith(f"{site}: the function given to fl.modify, ")
  assert "_buggy_edit, raised RuntimeError: a bug in my edit" in message
  assert "model's own code" not in message
  assert message.endswith("Fix the function (run with jit=False to debug it eagerly).")
  assert type(raised.value.__cause__) is RuntimeError
  assert str(raised.value.__cause__) == "a bug in my edit"


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_an_error_flaxlens_raises_during_a_run_passes_unchanged(corpora, fw):
  case = _positional(corpora, fw)
  tree = _replaced(fw, case, lambda node: WrongShape())
  with pytest.raises(fl.ReplacementError) as raised:
    _tree_call(tree, case.args[0], jit=False)
  assert type(raised.value) is fl.ReplacementError


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_native_call_a_replacement_continues_that_fails_is_explained(corpora, fw):
  case = _positional(corpora, fw)
  tokens = jnp.ones((2, 12), jnp.int32)
  native = _native_error(fw, case, tokens, jit=False)
  tree = _replaced(fw, case, PlusOne)
  _, ours = _tree_error(fw, case, tokens, jit=False, tree=tree)
  _same_error(ours, native)
  assert f"own code, in {TABLE_CALL[fw.name]} (" in str(ours)


TABLE_LABEL = {LINEN.name: "params:PositionTable_0/table", NNX.name: "Param:positions/table"}


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_a_failure_on_the_arguments_conversion_saw_points_at_the_trees_values(corpora, fw):
  case = _positional(corpora, fw)
  label, short = TABLE_LABEL[fw.name], jnp.zeros((2, 8))
  native = _native_error(fw, fw.with_variable(case, label, short), case.args[0], jit=False)
  tree = fw.convert(case)
  (table,) = [v for v in fl.variables_in(tree) if v.label == label]
  table.value = short
  _, ours = _tree_error(fw, case, case.args[0], jit=False, tree=tree)
  _same_error(ours, native)
  assert f"got ({CONVERTED}), as at conversion" in str(ours)
  assert "the values of its arguments or of the tree's variables" in str(ours)


# --- conversion on example arguments the model cannot take ----------------------------------


def _conversion_error(fw, case, tokens):
  converting = dataclasses.replace(case, args=(tokens,))
  with pytest.raises(fl.ModelCallError) as raised:
    fw.convert(converting)
  return raised.value


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_converting_on_token_ids_of_another_rank_raises_the_native_error_naming_them(corpora, fw):
  case = _positional(corpora, fw)
  tokens = case.args[0][0]
  native = _native_error(fw, case, tokens, jit=False)
  ours = _conversion_error(fw, case, tokens)
  assert isinstance(ours, type(native)) and type(ours.__cause__) is type(native)
  message = str(ours)
  assert message.startswith("unflaxify(") and "the model's own code failed (" in message
  assert "got (int32[4])" in message
  assert message.endswith("NNX: model(*args)).")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_converting_on_more_positions_than_the_table_holds_names_the_call_that_failed(corpora, fw):
  case = _positional(corpora, fw)
  tokens = jnp.ones((2, 12), jnp.int32)
  native = _native_error(fw, case, tokens, jit=False)
  ours = _conversion_error(fw, case, tokens)
  assert isinstance(ours, type(native)) and type(ours.__cause__) is type(native)
  table = TABLE_CALL[fw.name]
  assert f"own code failed in {table} (" in str(ours)
  assert f"{table} got (float32[2, 12, 8], 12)" in str(ours)


def test_a_flaxlens_error_during_conversion_passes_unchanged():
  class Branchy(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(x) if float(x.sum()) > 0 else x  # A branch on a traced value.

  x = jnp.ones((1, 3))
  with pytest.raises(fl.FlaxlensError) as raised:
    fl.unflaxify(Branchy(), Branchy().init(jax.random.key(0), x), x)
  assert not isinstance(raised.value, fl.ModelCallError)
