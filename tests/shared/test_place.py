"""`fl.place`: an intervention is a layer wrapping the call it edits, kept in the tree.

A placed tree's call must equal the native model with the same edit written by hand
(`frameworks.Wrap`), inside lifted transforms at every iteration too; its interventions'
arrays are leaves, so a compiled call of it serves every value; export refuses it as it
refuses any replaced call.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from comparisons import assert_trees_equal, compilations
from frameworks import LINEN, NNX, Wrap
from nnx import corpus as nnx_corpus

import flaxlens as fl

EDITED = [
  (LINEN, "mlp", "Dense_0", 16),
  (NNX, "mlp", "hidden", 8),
  # Inside transforms: the placed edit applies at every iteration / member.
  (LINEN, "scan", "layers/Dense_0", 8),
  (LINEN, "vmap", "ensemble", 4),
  (NNX, "scan", "blocks/linear", 4),
  (NNX, "vmap_ensemble", "members", 2),
]


def _vector(features):
  return jnp.linspace(-1.0, 1.0, features, dtype=jnp.float32)


@pytest.mark.parametrize("fw, name, path, features", EDITED)
def test_a_placed_steer_equals_the_native_edit(corpora, fw, name, path, features):
  case = corpora[fw][name]
  tree = fw.convert(case)
  vector = _vector(features)
  placed = fl.place(tree, fl.steer(path, vector, alpha=0.5))
  alpha = jnp.asarray(0.5, jnp.float32)
  expected, _ = fw.native(case, wrap=Wrap(path, lambda out, *a: out + alpha * vector))
  assert_trees_equal(fw.call(placed, case), expected)


@pytest.mark.parametrize("fw, name, path, features", EDITED[:2])
def test_a_placed_input_edit_and_output_edit_of_one_call_equal_the_native_edits(
  corpora, fw, name, path, features
):
  case = corpora[fw][name]
  tree = fw.convert(case)
  placed = fl.place(tree, [fl.scale(path, 2.0), fl.scale(path, 0.25, where=(..., 0))])
  plain = fw.call(tree, case)  # the unedited output differs from the edited one
  expected, _ = fw.native(
    case,
    wrap=Wrap(
      path,
      lambda out, *a: jnp.where(
        jnp.zeros(out.shape, bool).at[..., 0].set(True),
        out * jnp.asarray(2.0, jnp.float32) * jnp.asarray(0.25, jnp.float32),
        out * jnp.asarray(2.0, jnp.float32),
      ),
    ),
  )
  got = fw.call(placed, case)
  assert_trees_equal(got, expected)
  assert not np.array_equal(np.asarray(got), np.asarray(plain))


@pytest.mark.parametrize("fw, name, path, features", EDITED[:3])
def test_a_compiled_placed_tree_takes_new_values_without_recompiling(
  corpora, fw, name, path, features
):
  case = corpora[fw][name]
  run = fl.variable_jit(lambda t, argument: t(argument, **fw.side_inputs(case)))
  argument = fw.argument(case)
  tree, counts = fw.convert(case), []
  for alpha in (0.5, -2.0, 3.0):
    placed = fl.place(tree, fl.steer(path, _vector(features), alpha=alpha))
    with compilations() as compiled:
      got = run(placed, argument)
    counts.append(len(compiled))
    a = jnp.asarray(alpha, jnp.float32)
    edit = Wrap(path, lambda out, *_, a=a: out + a * _vector(features))
    expected, _ = fw.native(case, jit=True, wrap=edit)
    # Natively alpha is a constant XLA may fold into a fused multiply-add; here it is an
    # input of the program: equal to rounding (the eager tests above are bit for bit).
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)
  assert counts[0] >= 1 and counts[1:] == [0, 0], counts


@pytest.mark.parametrize("fw, name, path, features", EDITED[:2])
def test_placing_leaves_the_tree_unchanged(corpora, fw, name, path, features):
  case = corpora[fw][name]
  tree = fw.convert(case)
  fl.place(tree, fl.ablate(path))
  expected, _ = fw.native(case)
  assert_trees_equal(fw.call(tree, case), expected)


@pytest.mark.parametrize("fw, name, path, features", EDITED[:2])
def test_export_refuses_a_placed_tree_naming_the_edited_call(corpora, fw, name, path, features):
  tree = fl.place(fw.convert(corpora[fw][name]), fl.ablate(path))
  with pytest.raises(fl.ExportError, match=path.split("/")[-1]):
    fw.export(tree)


@pytest.mark.parametrize("fw, name, path, features", EDITED[:2])
def test_placing_an_edit_of_the_root_call_is_refused(corpora, fw, name, path, features):
  tree = fw.convert(corpora[fw][name])
  with pytest.raises(fl.ArgumentError, match="root call.*fl.run"):
    fl.place(tree, fl.ablate(tree))


@pytest.mark.parametrize("fw, name, path, features", EDITED[:2])
def test_placing_at_a_site_that_matches_nothing_names_the_closest(
  corpora, fw, name, path, features
):
  tree = fw.convert(corpora[fw][name])
  with pytest.raises(fl.SelectionError):
    fl.place(tree, fl.ablate(path + "_nope"))


@pytest.mark.parametrize(
  "fw, attention",
  [(LINEN, "TransformerBlock_1/MultiHeadDotProductAttention_0"), (NNX, "blocks/1/attention")],
)
def test_a_placed_head_ablation_equals_the_native_model_with_that_heads_values_zeroed(
  corpora, fw, attention
):
  if fw is LINEN:
    case = corpora[LINEN]["transformer"]
  else:
    model = nnx_corpus.Transformer(nnx_corpus.RNGS())
    case = nnx_corpus.Case("transformer", model, (nnx_corpus.TOKENS,))
  placed = fl.place(fw.convert(case), fl.ablate(fl.heads(attention, 1)))
  # Head 1's output is its attention weights times its values: zero when they are.
  expected, _ = fw.native(
    case, wrap=Wrap(f"{attention}/value", lambda out, *a: out.at[..., 1, :].set(0.0))
  )
  assert_trees_equal(fw.call(placed, case), expected)
