"""`fl.splice`: a call's output replaced by a Linen or NNX module's reconstruction.

With the error term, the tree's output is the native model's, bit for bit; the spliced
module's features are sites, captured as the module computes them natively on the
call's native output, and ablating one equals the same splice written by hand around the
native model (`frameworks.Wrap`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import LINEN, NNX, Wrap

import flaxlens as fl

SITES = {LINEN: "TransformerBlock_0", NNX: "blocks/0"}


class LinenSAE(nn.Module):
  def setup(self):
    self.enc, self.dec = nn.Dense(32), nn.Dense(8)

  def encode(self, x):
    return nn.relu(self.enc(x))

  def decode(self, f):
    return self.dec(f)

  def __call__(self, x):
    return self.decode(self.encode(x))


class NNXSAE(nnx.Module):
  def __init__(self, rngs):
    self.enc, self.dec = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)

  def encode(self, x):
    return nnx.relu(self.enc(x))

  def decode(self, f):
    return self.dec(f)

  def __call__(self, x):
    return self.decode(self.encode(x))


class SAE:
  """One SAE of a framework: how to splice it, and its methods called natively."""

  def __init__(self, fw):
    self.fw = fw
    if fw is LINEN:
      self.module = LinenSAE()
      self.variables = self.module.init(jax.random.key(3), jnp.ones((1, 8)))
    else:
      self.module, self.variables = NNXSAE(nnx.Rngs(3)), None

  def splice(self, tree, at, **options):
    if self.variables is None:
      return fl.splice(tree, at, self.module, **options)
    return fl.splice(tree, at, self.module, self.variables, **options)

  def native(self, method, x):
    if self.variables is None:
      return getattr(self.module, method)(x)
    return self.module.apply(self.variables, x, method=method)


def _case(corpora, fw):
  case = corpora[fw]["transformer"]
  return case, fw.convert(case)


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_a_splice_with_the_error_term_leaves_the_output_unchanged(corpora, fw):
  case, tree = _case(corpora, fw)
  spliced = SAE(fw).splice(tree, SITES[fw])
  assert_trees_equal(fw.call(spliced, case), fw.native(case)[0])
  assert_trees_equal(fl.run(spliced, fw.argument(case)), fw.native(case, jit=True)[0])


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_captured_features_equal_the_native_sae_on_the_native_activation(corpora, fw):
  case, tree = _case(corpora, fw)
  sae = SAE(fw)
  site = SITES[fw]
  _, cache = fl.capture(
    SAE(fw).splice(tree, site), fw.argument(case), f"{site}/sae.encode", jit=False
  )
  _, native = fw.native_captures(case)
  activation = native[(*tree.select().at_path(site).get().path, "__call__")][0]
  assert_trees_equal(cache[f"{site}/sae.encode"], sae.native("encode", activation))


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_ablating_a_feature_equals_the_native_hand_written_splice(corpora, fw):
  case, tree = _case(corpora, fw)
  sae = SAE(fw)
  site = SITES[fw]
  spliced = sae.splice(tree, site)
  ablation = fl.ablate(f"{site}/sae.encode", where=jnp.s_[..., 5])
  got = fl.run(spliced, fw.argument(case), interventions=[ablation], jit=False)

  def by_hand(y, *args):
    features = sae.native("encode", y)
    edited = sae.native("decode", features.at[..., 5].set(0.0))
    return y - (sae.native("__call__", y) - edited)

  expected, _ = fw.native(case, wrap=Wrap(site, by_hand))
  assert_trees_equal(got, expected)
  assert not jnp.array_equal(got, fw.native(case)[0])


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_without_the_error_term_the_reconstruction_replaces_the_output(corpora, fw):
  case, tree = _case(corpora, fw)
  sae = SAE(fw)
  site = SITES[fw]
  got = fw.call(sae.splice(tree, site, error=False), case)
  expected, _ = fw.native(case, wrap=Wrap(site, lambda y, *a: sae.native("__call__", y)))
  assert_trees_equal(got, expected)


def test_a_transcoder_reads_the_calls_input_and_replaces_its_output(corpora):
  case, tree = _case(corpora, LINEN)
  transcoder = nn.Dense(8)
  variables = transcoder.init(jax.random.key(4), jnp.ones((1, 16)))
  site = "TransformerBlock_0/Dense_0"  # the MLP output projection: 16 features in, 8 out
  spliced = fl.splice(tree, site, transcoder, variables, reads="input", error=False)
  expected, _ = LINEN.native(case, wrap=Wrap(site, lambda y, x: transcoder.apply(variables, x)))
  assert_trees_equal(LINEN.call(spliced, case), expected)
  _, cache = fl.capture(spliced, LINEN.argument(case), "TransformerBlock_0/Dense_0/transcoder")
  assert cache["TransformerBlock_0/Dense_0/transcoder"].shape[-1] == 8


def test_a_module_returning_another_shape_is_refused_naming_the_site(corpora):
  case, tree = _case(corpora, LINEN)
  wide = nn.Dense(9)
  spliced = fl.splice(tree, "TransformerBlock_0", wide, wide.init(jax.random.key(0), jnp.ones(8)))
  with pytest.raises(
    fl.ArgumentError, match=r"TransformerBlock_0: the spliced module sae returned"
  ):
    LINEN.call(spliced, case)


def test_a_splice_of_several_calls_is_refused(corpora):
  _, tree = _case(corpora, LINEN)
  sae = SAE(LINEN)
  with pytest.raises(fl.ArgumentError, match="names 2 calls"):
    sae.splice(tree, "TransformerBlock_*")


def test_a_spliced_modules_submodule_is_not_matched_by_the_outer_trees_paths(corpora):
  _, tree = _case(corpora, LINEN)
  spliced = SAE(LINEN).splice(tree, "TransformerBlock_0")
  _, cache = fl.capture(spliced, LINEN.argument(corpora[LINEN]["transformer"]), "**/enc")
  assert sorted(cache) == ["TransformerBlock_0/sae/enc"]


def test_an_edit_placed_inside_a_spliced_module_is_refused_naming_fl_run(corpora):
  case, tree = _case(corpora, LINEN)
  spliced = SAE(LINEN).splice(tree, SITES[LINEN])
  placed = fl.place(spliced, fl.ablate(f"{SITES[LINEN]}/sae.encode", where=jnp.s_[..., 5]))
  with pytest.raises(fl.UnsupportedFlaxFeatureError, match=r"Pass edits of its calls to fl.run"):
    LINEN.call(placed, case)
