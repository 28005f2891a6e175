"""Intervention sets saved with `fl.save_interventions` load back equal and run alike."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from frameworks import LINEN, NNX

import flaxlens as fl

# This module's package, which loading must be allowed to import `clip` from.
ALLOW = [__name__.partition(".")[0]]
# Per framework: the corpus case, its first and second layer, the class of both.
MODELS = {
  LINEN: ("mlp", "Dense_0", "Dense_1", nn.Dense),
  NNX: ("mlp", "hidden", "out", nnx.Linear),
}


def clip(argument, value, bound):
  """A function for fl.modify, defined at module level so that it can be saved."""
  return jnp.clip(value, -bound, bound)


def _model(fw, corpora):
  name, first, second, layer = MODELS[fw]
  case = corpora[fw][name]
  tree = fw.convert(case)
  args = fw.argument(case).args
  _, cache = fl.capture(tree, args, at=[first, second])
  return tree, args, first, second, layer, cache


def _every_kind(fw, corpora):
  """A set with every kind, where= form, on=, a class site and a list of sites."""
  tree, args, first, second, layer, cache = _model(fw, corpora)
  hidden = cache[first]
  width = hidden.shape[-1]
  key = jax.random.key(5)
  reference = jax.random.normal(jax.random.key(6), hidden.shape)
  interventions = [
    fl.ablate(first, where=jnp.s_[:, 1:3]),
    fl.ablate(first, "mean", reference, where=jnp.arange(width) % 2 == 0),
    fl.ablate(first, "resample", reference, key=key, where=jnp.s_[..., jnp.array([0, 2])]),
    fl.patch(first, hidden[::-1], where=jnp.s_[1]),
    fl.steer([first, second], jnp.linspace(-1.0, 1.0, width).astype(jnp.bfloat16)[:1], 0.25),
    fl.steer(first, jax.random.normal(key, (width,)), alpha=jnp.array(3.0)),
    fl.scale(layer, 0.5, on="input"),
    fl.modify(second, clip, 0.1, where=jnp.s_[:, None, -1]),
  ]
  return tree, args, interventions


def _assert_same(loaded, original):
  assert len(loaded) == len(original)
  for new, old in zip(loaded, original, strict=True):
    assert (new.kind, new.at, new.on, new.part, new.index) == (
      old.kind,
      old.at,
      old.on,
      old.part,
      old.index,
    )
    assert new.fn is old.fn
    for a, b in zip(
      (*new.operands, *new.where_arrays), (*old.operands, *old.where_arrays), strict=True
    ):
      assert (a.dtype, a.shape, a.weak_type) == (b.dtype, b.shape, b.weak_type)
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_a_saved_set_loads_back_with_the_same_kinds_sites_and_arrays(fw, corpora, tmp_path):
  _, _, interventions = _every_kind(fw, corpora)
  fl.save_interventions(interventions, tmp_path / "set")
  _assert_same(fl.load_interventions(tmp_path / "set", allow=ALLOW), interventions)


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_a_loaded_set_runs_bit_for_bit_like_the_original(fw, corpora, tmp_path, jit):
  tree, args, interventions = _every_kind(fw, corpora)
  fl.save_interventions(interventions, tmp_path / "set")
  loaded = fl.load_interventions(tmp_path / "set", allow=ALLOW)
  expected = fl.run(tree, args, interventions=interventions, jit=jit)
  assert not np.array_equal(expected, fl.run(tree, args, jit=jit))
  np.testing.assert_array_equal(fl.run(tree, args, interventions=loaded, jit=jit), expected)


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_a_loaded_set_reuses_the_program_compiled_for_the_original(fw, corpora, tmp_path):
  tree, args, interventions = _every_kind(fw, corpora)
  fl.save_interventions(interventions, tmp_path / "set")
  loaded = fl.load_interventions(tmp_path / "set", allow=ALLOW)
  fl.run(tree, args, interventions=interventions)
  compiled = []

  def listen(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":  # jax/_src/dispatch.py
      compiled.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    fl.run(tree, args, interventions=loaded)
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert compiled == []


def test_the_module_class_of_a_site_loads_without_allowing_its_flax_package(tmp_path):
  fl.save_interventions([fl.ablate(nnx.Linear), fl.scale(nn.Dense, 2.0)], tmp_path / "set")
  assert [i.at for i in fl.load_interventions(tmp_path / "set")] == [nnx.Linear, nn.Dense]


@pytest.mark.parametrize("fw", [LINEN, NNX])
def test_a_call_node_site_is_refused_with_its_path_pattern(fw, corpora, tmp_path):
  tree, _, first, *_ = _model(fw, corpora)
  node = tree.select().at_path(first).get()
  with pytest.raises(fl.ArtifactError, match=f"at='{first}'"):
    fl.save_interventions([fl.ablate(node)], tmp_path / "set")
  assert not (tmp_path / "set").exists()


@pytest.mark.parametrize(
  "site", [lambda node: True, [lambda node: True, "Dense_0"]], ids=["predicate", "in_a_list"]
)
def test_a_predicate_site_is_refused_and_a_path_pattern_suggested(site, tmp_path):
  with pytest.raises(fl.ArtifactError, match="predicate.*path patterns"):
    fl.save_interventions([fl.ablate(site)], tmp_path / "set")


def test_a_site_class_that_is_not_a_flax_module_is_refused(tmp_path):
  with pytest.raises(fl.ArtifactError, match="not a Flax module class"):
    fl.save_interventions([fl.ablate(dict)], tmp_path / "set")


def test_a_lambda_given_to_modify_is_refused_and_module_level_asked_for(tmp_path):
  edit = fl.modify("Dense_0", lambda argument, value: value * 2)
  with pytest.raises(fl.ArtifactError, match="Define it at module level"):
    fl.save_interventions([edit], tmp_path / "set")


def test_saving_something_that_is_not_an_intervention_is_an_argument_error(tmp_path):
  with pytest.raises(fl.ArgumentError, match="element 1 is 'Dense_1'"):
    fl.save_interventions([fl.ablate("Dense_0"), "Dense_1"], tmp_path / "set")


def test_a_modify_function_from_a_package_not_allowed_is_refused(tmp_path):
  fl.save_interventions([fl.modify("Dense_0", clip, 1.0)], tmp_path / "set")
  with pytest.raises(fl.ArtifactError, match=rf"allow=\[{ALLOW[0]!r}\]"):
    fl.load_interventions(tmp_path / "set")


def test_one_intervention_not_in_a_list_saves_as_a_set_of_one(tmp_path):
  # As fl.run takes it: `interventions=edit` is `interventions=[edit]`.
  fl.save_interventions(fl.ablate("Dense_0"), tmp_path / "set")
  (loaded,) = fl.load_interventions(tmp_path / "set")
  assert repr(loaded) == repr(fl.ablate("Dense_0"))


@pytest.mark.parametrize("bad", [None, "Dense_0", [fl.ablate("Dense_0"), None]], ids=repr)
def test_saving_anything_but_interventions_is_an_argument_error(tmp_path, bad):
  with pytest.raises(fl.ArgumentError, match="save_interventions: interventions must be a list"):
    fl.save_interventions(bad, tmp_path / "set")
