"""Edits and captures of a call that a run does not make raise, unless the run allows it.

A model may skip a call on another input than conversion saw (a Python branch on a
shape). An intervention or capture that names the skipped call would be dropped without
a trace, so the run raises `fl.CallStructureError` naming the site, as a skipped
replaced call does; `unreached="ignore"` lets edits and captures apply only where the
run makes their calls. Capturing every call captures the calls the run makes. The models
here call `extra` only for a batch of more than one example; they are converted on a
batch of two and run on a batch of one.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import FRAMEWORKS, LINEN, Wrap
from linen import corpus as linen_corpus
from nnx import corpus as nnx_corpus

import flaxlens as fl

X2 = jax.random.normal(jax.random.key(0), (2, 3))
X1 = X2[:1]
SKIPPED = r"\['extra'\].*unreached='ignore'"


class LinenOptional(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4, name="main")(x)
    if x.shape[0] > 1:  # Several examples are also mixed.
      h = h + nn.Dense(4, name="extra")(x.mean(0, keepdims=True))
    return h


class NNXOptional(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.main = nnx.Linear(3, 4, rngs=rngs)
    self.extra = nnx.Linear(3, 4, rngs=rngs)

  def __call__(self, x):
    h = self.main(x)
    if x.shape[0] > 1:  # Several examples are also mixed.
      h = h + self.extra(x.mean(0, keepdims=True))
    return h


def _cases(fw):
  """The model's case on the batch of two (converted) and on the batch of one (run)."""
  if fw is LINEN:
    module = LinenOptional()
    variables = dict(module.init(jax.random.key(1), X2))
    converted = linen_corpus.Case("optional_call", module, variables, (X2,))
  else:
    converted = nnx_corpus.Case("optional_call", NNXOptional(nnx.Rngs(1)), (X2,))
  return converted, dataclasses.replace(converted, args=(X1,))


FWS = list(FRAMEWORKS.values())
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


@pytest.mark.parametrize("fw", FWS)
@JIT
def test_an_edit_of_a_call_the_run_skips_raises_naming_it(fw, jit):
  converted, _ = _cases(fw)
  tree = fw.convert(converted)
  with pytest.raises(fl.CallStructureError, match=SKIPPED):
    fl.run(tree, X1, interventions=[fl.ablate("extra")], jit=jit)


@pytest.mark.parametrize("fw", FWS)
@JIT
def test_a_capture_of_a_call_the_run_skips_raises_naming_it(fw, jit):
  converted, _ = _cases(fw)
  tree = fw.convert(converted)
  with pytest.raises(fl.CallStructureError, match=SKIPPED):
    fl.capture(tree, X1, at=["main", "extra"], jit=jit)


@pytest.mark.parametrize("fw", FWS)
def test_a_saved_edit_of_a_call_the_run_skips_raises_naming_it(fw, tmp_path):
  converted, _ = _cases(fw)
  tree = fw.convert(converted)
  fl.save_interventions([fl.steer("extra", jnp.ones(4), alpha=2.0)], tmp_path / "edits")
  loaded = fl.load_interventions(tmp_path / "edits")
  with pytest.raises(fl.CallStructureError, match=SKIPPED):
    fl.run(tree, X1, interventions=loaded)


@pytest.mark.parametrize("fw", FWS)
@JIT
def test_with_unreached_ignore_only_the_calls_the_run_makes_are_edited(fw, jit):
  converted, run = _cases(fw)
  tree = fw.convert(converted)
  edits = [fl.scale("main", 2.0), fl.ablate("extra")]
  out = fl.run(tree, X1, interventions=edits, jit=jit, unreached="ignore")
  native, _ = fw.native(run, wrap=Wrap("main", lambda y, *a: y * jnp.float32(2.0)))
  assert_trees_equal(out, native)


@pytest.mark.parametrize("fw", FWS)
@JIT
def test_with_unreached_ignore_skipped_captures_are_left_out(fw, jit):
  converted, run = _cases(fw)
  tree = fw.convert(converted)
  out, cache = fl.capture(tree, X1, at=["main", "extra"], jit=jit, unreached="ignore")
  native_out, native = fw.native_captures(run, jit=jit)
  assert sorted(cache) == ["main"]
  assert_trees_equal(cache["main"], native[("main", "__call__")][0])
  assert_trees_equal(out, native_out)


@pytest.mark.parametrize("fw", FWS)
def test_capturing_every_call_captures_the_calls_the_run_makes(fw):
  converted, run = _cases(fw)
  tree = fw.convert(converted)
  _, cache = fl.capture(tree, X1)
  _, native = fw.native_captures(run, jit=True)
  assert "extra" not in cache
  assert_trees_equal(cache["main"], native[("main", "__call__")][0])


@pytest.mark.parametrize("fw", FWS)
@JIT
@pytest.mark.parametrize("every", ["capture", "edit"])
def test_every_call_on_a_run_making_a_call_conversion_did_not_see_raises(fw, jit, every):
  # Converted on one example, run on two: `extra` has no node, and what it calls would run
  # unseen, so "every call" would silently mean "every call conversion saw".
  _, converted = _cases(fw)
  tree = fw.convert(converted)
  with pytest.raises(fl.CallStructureError, match=r"conversion did not see .*extra"):
    if every == "capture":
      fl.capture(tree, X2, jit=jit)
    else:
      fl.run(tree, X2, interventions=[fl.scale("**", 1.0)], jit=jit)


@pytest.mark.parametrize("fw", FWS)
def test_every_call_with_unreached_ignore_captures_the_calls_that_line_up(fw):
  _, converted = _cases(fw)
  tree = fw.convert(converted)
  out, cache = fl.capture(tree, X2, unreached="ignore")
  native_out, native = fw.native_captures(dataclasses.replace(converted, args=(X2,)), jit=True)
  assert "extra" not in cache
  assert_trees_equal(cache["main"], native[("main", "__call__")][0])
  assert_trees_equal(out, native_out)


TOOLS = {
  # One clean example against a corrupted batch (it broadcasts); the clean run skips.
  "sweep": lambda tree: fl.sweep(tree, X1, X2, "extra", lambda out: out.sum()),
  "attribute": lambda tree: fl.attribute(tree, X1, X2, "extra", lambda out: out.sum()),
  "grad_at": lambda tree: fl.grad_at(tree, X1, "extra", lambda out: out.sum()),
}


@pytest.mark.parametrize("fw", FWS)
@pytest.mark.parametrize("tool", list(TOOLS))
def test_sweeps_attribution_and_gradients_refuse_a_site_a_run_skips(fw, tool):
  converted, _ = _cases(fw)
  tree = fw.convert(converted)
  with pytest.raises(fl.CallStructureError, match=r"\['extra'\].*every run makes"):
    TOOLS[tool](tree)


JitLinenDense = nn.jit(nn.Dense)  # Made once: its trace cache outlives each apply.


class LinenJitted(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="out")(nn.relu(JitLinenDense(4, name="block")(x)))


@nnx.jit
def _nnx_jitted(block, x):
  return block(x)


class NNXJitted(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.block = nnx.Linear(3, 4, rngs=rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(_nnx_jitted(self.block, x)))


@pytest.mark.parametrize("fw", FWS)
def test_an_edit_inside_an_inner_jit_replayed_from_its_cache_is_made(fw):
  # Eager runs with the same edit share the inner jit's trace: the second and third
  # run replay it without running the body's Python, and still make the edited call.
  if fw is LINEN:
    module = LinenJitted()
    case = linen_corpus.Case("jitted", module, dict(module.init(jax.random.key(1), X2)), (X2,))
  else:
    case = nnx_corpus.Case("jitted", NNXJitted(nnx.Rngs(1)), (X2,))
  tree = fw.convert(case)
  edits = [fl.scale("block", 2.0)]
  native, _ = fw.native(case, wrap=Wrap("block", lambda y, *a: y * jnp.float32(2.0)))
  for _ in range(3):
    assert_trees_equal(fl.run(tree, X2, interventions=edits, jit=False), native)


class LinenStep(nn.Module):
  @nn.compact
  def __call__(self, carry, x):
    carry = jnp.tanh(nn.Dense(4, name="mix")(carry) + x.sum(-1, keepdims=True))
    return carry, carry


class LinenLoop(nn.Module):
  @nn.compact
  def __call__(self, xs):
    cell = nn.scan(
      LinenStep,
      variable_broadcast="params",
      split_rngs={"params": False},
      in_axes=1,
      out_axes=1,
    )
    carry, _ = cell(name="steps")(jnp.zeros((xs.shape[0], 4)), xs)
    return carry


class NNXLoop(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.mix = nnx.Linear(4, 4, rngs=rngs)

  @nnx.scan(in_axes=(None, nnx.Carry, 1), out_axes=(nnx.Carry, 1))
  def steps(self, carry, x):
    carry = jnp.tanh(self.mix(carry) + x.sum(-1, keepdims=True))
    return carry, carry

  def __call__(self, xs):
    carry, _ = self.steps(jnp.zeros((xs.shape[0], 4)), xs)
    return carry


@pytest.mark.parametrize("fw", FWS)
def test_a_call_in_a_scan_body_that_runs_no_iteration_is_made_and_captured_empty(fw):
  # The scan body is traced (its calls are made) even when the loop runs no iteration;
  # its captures stack nothing along the scan axis.
  xs = jax.random.normal(jax.random.key(2), (2, 5, 3))
  if fw is LINEN:
    module = LinenLoop()
    converted = linen_corpus.Case("loop", module, dict(module.init(jax.random.key(1), xs)), (xs,))
    site = "steps/mix"
  else:
    converted = nnx_corpus.Case("loop", NNXLoop(nnx.Rngs(1)), (xs,))
    site = "mix"
  tree = fw.convert(converted)
  empty = xs[:, :0]
  out, cache = fl.capture(tree, empty, at=site)
  native, _ = fw.native(dataclasses.replace(converted, args=(empty,)))
  assert_trees_equal(out, native)
  assert cache[site].shape == (0, 2, 4)
