"""A site object written outside flaxlens plugs into every tool its protocols allow.

`FirstFeatures(at, k)`, defined here only, names the first `k` features of the outputs of
the calls `at` names. It implements the protocols of `flaxlens.extend` (`SiteObject`,
`Intervenable`, `Sweepable`, `PathPatchable`) with public names only (`flaxlens.extend`:
`Edit`, `RecordingEdit`, `select_sites`, `active_probing`, the result tuples; `fl.Struct`),
and is checked against the same edits written natively by hand, on a Linen and an NNX
model whose weights and inputs are multiples of 1/4 (every float32 operation exact), bit
for bit. A site object lacking a capability is refused by the tool needing it, naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from frameworks import LINEN, NNX

import flaxlens as fl
from flaxlens import Struct, static_field
from flaxlens.errors import FlaxlensError
from flaxlens.extend import (
  Edit,
  Intervenable,
  PathPatchable,
  PathSites,
  RecordingEdit,
  SiteObject,
  Sweepable,
  SweptUnits,
  active_probing,
  select_sites,
)

WIDTH, K = 4, 2

# --- the site object, as an extension writes it -------------------------------------------


class FirstFeaturesEdit(Struct):
  """Runs `intervention` on the first `k` features of the call's output, keeping the rest."""

  intervention: Any
  k: int = static_field()
  on: str = static_field(default="output")
  part: Any = static_field(default=None)

  def edit(self, site, argument, value):
    return value.at[..., : self.k].set(self.intervention.edit(site, argument, value[..., : self.k]))


class FirstFeaturesCapture(Struct):
  """Records the first `k` features of the call's output as `key`, changing nothing."""

  records = True
  key: str = static_field()
  k: int = static_field()
  shape: Any = static_field(default=None)
  on: str = static_field(default="output")
  part: Any = static_field(default=None)

  def edit(self, site, argument, value):
    probing = active_probing()
    if probing is not None:
      probing.record(self.key, value[..., : self.k], self.shape)
    return value


@dataclasses.dataclass(frozen=True)
class CaptureOnly:
  """A site object that can only be captured: the first `k` features of `at`'s outputs."""

  at: str
  k: int

  def key(self, name: str) -> str:
    return f"{name}:first{self.k}"

  def capture_edits(self, tree, sites, shape):
    out = []
    for site in select_sites(tree, self.at, sites):
      key = self.key(site.name)
      shaped = None if shape is None else (lambda x, key=key: shape(key, x))
      out.append((site, FirstFeaturesCapture(key, self.k, shaped)))
    return out


@dataclasses.dataclass(frozen=True)
class FirstFeatures(CaptureOnly):
  """The first `k` features of `at`'s outputs, with every capability."""

  def edits_of(self, tree, sites, intervention):
    inner = dataclasses.replace(intervention, part=None)
    return [(site, FirstFeaturesEdit(inner, self.k)) for site in select_sites(tree, self.at, sites)]

  def sweep_units(self, tree, clean, corrupted, metric, options):
    """One row per feature: the corrupted run with that feature's clean value patched."""
    if options.positions is not None or options.part is not None:
      raise fl.errors.ArgumentError(f"{self!r}: positions= and part= are not taken here.")
    clean_output, cache = fl.capture(tree, clean, at=self.at)
    corrupted_output = fl.run(tree, corrupted)
    values, names = [], []
    for name in [n for n in cache if not n.endswith(":input")]:
      for feature in range(self.k):

        def set_feature(argument, value, kept, j=feature):
          return value.at[..., j].set(kept[..., j])

        patched = fl.modify(name, set_feature, cache[name])
        values.append(metric(fl.run(tree, corrupted, interventions=[patched])))
        names.append(f"{name} feature {feature}")
    return SweptUnits(
      jnp.stack(values), tuple(names), None, metric(clean_output), metric(corrupted_output)
    )

  def path_sites(self, tree):
    calls = [site.name for site in select_sites(tree, self.at)]
    return PathSites(calls, "output", [jnp.s_[..., j] for j in range(self.k)], {})


def test_the_site_objects_satisfy_the_protocols_they_implement():
  assert isinstance(FirstFeatures("a", K), Intervenable | Sweepable | PathPatchable)
  assert isinstance(FirstFeatures("a", K), Sweepable) and isinstance(
    FirstFeatures("a", K), PathPatchable
  )
  only = CaptureOnly("a", K)
  assert isinstance(only, SiteObject)
  assert not isinstance(only, Intervenable | Sweepable | PathPatchable)
  assert isinstance(FirstFeaturesEdit(None, K), Edit)
  assert isinstance(FirstFeaturesCapture("a", K), RecordingEdit)


# --- the models, run natively with hooks --------------------------------------------------


def _quarters(x):
  return jnp.clip(jnp.round(x * 4) / 4, -1.0, 1.0)


class LinenChain(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(WIDTH, name="a")(x))
    return nn.Dense(2, name="out")(nn.Dense(WIDTH, name="b")(h))


class NNXChain(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.b = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.out = nnx.Linear(WIDTH, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(self.b(nnx.relu(self.a(x))))


class Native:
  """A model run natively: `run(x, hooks)`, `hooks[path](output) -> new output`."""

  def __init__(self, framework):
    self.framework = framework
    self.x = _quarters(jax.random.normal(jax.random.key(5), (3, WIDTH)) * 2)
    if framework is LINEN:
      self.model = LinenChain()
      init = self.model.init(jax.random.key(0), self.x)
      self.variables = jax.tree_util.tree_map(_quarters, init)
    else:
      self.model = NNXChain(nnx.Rngs(0))
      for number, (_, variable) in enumerate(nnx.iter_graph(self.model)):
        if isinstance(variable, nnx.Param):
          noise = jax.random.normal(jax.random.key(number), variable.value.shape)
          variable.value = _quarters(noise)

  def tree(self):
    if self.framework is LINEN:
      return fl.unflaxify(self.model, self.variables, self.x)
    return fl.unflaxify(self.model, self.x)

  def run(self, x, hooks=None):
    hooks = hooks or {}
    if self.framework is LINEN:

      def interceptor(next_fun, args, kwargs, context):
        output = next_fun(*args, **kwargs)
        hook = hooks.get("/".join(context.module.path))
        return output if hook is None else hook(output)

      with nn.intercept_methods(interceptor):
        return self.model.apply(self.variables, x)
    model = nnx.clone(self.model)
    for path, hook in hooks.items():
      module = getattr(model, path)
      object.__setattr__(module, "__class__", _hooked(type(module), hook))
    return model(x)

  def output_of(self, x, path):
    store = {}

    def keep(output):
      store[path] = output
      return output

    self.run(x, {path: keep})
    return store[path]


def _hooked(cls, hook):
  class Hooked(cls):
    def __call__(self, *args, **kwargs):
      return hook(super().__call__(*args, **kwargs))

  return Hooked


def _metric(out):
  return out[..., 0]


@pytest.fixture(scope="module", params=[LINEN, NNX], ids=["linen", "nnx"])
def native(request):
  return Native(request.param)


# --- the tools, against the native edits --------------------------------------------------


def test_capturing_it_records_the_first_features_of_the_call(native):
  _, cache = fl.capture(native.tree(), native.x, at=FirstFeatures("a", K))
  np.testing.assert_array_equal(cache["a:first2"], native.output_of(native.x, "a")[..., :K])


def test_ablating_it_zeroes_the_first_features_natively(native):
  out = fl.run(native.tree(), native.x, interventions=[fl.ablate(FirstFeatures("a", K))])
  expected = native.run(native.x, {"a": lambda y: y.at[..., :K].set(0.0)})
  np.testing.assert_array_equal(out, expected)
  assert not np.array_equal(out, native.run(native.x))  # the edit matters


def test_scaling_it_compiled_scales_the_first_features_natively(native):
  compiled = fl.variable_jit(
    lambda tree, x: fl.run(tree, x, interventions=[fl.scale(FirstFeatures("b", K), 0.5)])
  )
  expected = native.run(native.x, {"b": lambda y: y.at[..., :K].multiply(0.5)})
  np.testing.assert_array_equal(compiled(native.tree(), native.x), expected)


def test_sweeping_it_patches_each_feature_from_the_clean_run(native):
  clean, corrupted = native.x, native.x[::-1]
  result = fl.sweep(native.tree(), clean, corrupted, FirstFeatures("a", K), _metric)
  kept = native.output_of(clean, "a")
  expected = [
    _metric(native.run(corrupted, {"a": lambda y, j=j: y.at[..., j].set(kept[..., j])}))
    for j in range(K)
  ]
  assert result.sites == ("a feature 0", "a feature 1")
  np.testing.assert_array_equal(result.values, np.stack(expected))
  np.testing.assert_array_equal(result.clean, _metric(native.run(clean)))
  np.testing.assert_array_equal(result.corrupted, _metric(native.run(corrupted)))


def test_path_patching_it_sends_each_feature_through_the_receiver_alone(native):
  clean, corrupted = native.x, native.x[::-1]
  result = fl.path_patch(native.tree(), clean, corrupted, FirstFeatures("a", K), "out", _metric)
  sent = native.output_of(corrupted, "a")
  expected = [
    _metric(native.run(clean, {"a": lambda y, j=j: y.at[..., j].set(sent[..., j])}))
    for j in range(K)
  ]
  np.testing.assert_array_equal(result.values, np.stack(expected))


def test_a_site_object_missing_a_capability_is_refused_naming_it(native):
  tree, only = native.tree(), CaptureOnly("a", K)
  with pytest.raises(FlaxlensError, match=r"cannot be intervened on: it has no edits_of"):
    fl.run(tree, native.x, interventions=[fl.ablate(only)])
  with pytest.raises(FlaxlensError, match=r"cannot be swept: it has no sweep_units"):
    fl.sweep(tree, native.x, native.x[::-1], only, _metric)
  with pytest.raises(FlaxlensError, match=r"cannot be path-patched: it has no path_sites"):
    fl.path_patch(tree, native.x, native.x[::-1], only, "out", _metric)
  with pytest.raises(FlaxlensError, match=r"resolves itself, and this takes site patterns"):
    fl.splice(tree, only, nn.Dense(WIDTH))
