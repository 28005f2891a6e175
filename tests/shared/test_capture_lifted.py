"""Captures inside composed lifted transforms: one site per call, Flax's values, stacked.

A scan over a rematerialized block (`nn.scan(nn.remat(Block))`, the usual way to save
memory over many layers), a remat over a scan, and deeper compositions: each call in the
body is one site however often Flax traces the body, captured stacked along the scan
axis. The Linen models declare the `intermediates` collection in the scan so that
Flax's own `capture_intermediates` carries values out; NNX's `nnx.capture` does so
itself. Every site must equal Flax's capture bit for bit, eagerly and under jit.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import FRAMEWORKS, LINEN
from linen import corpus as linen_corpus
from nnx import corpus as nnx_corpus

import flaxlens as fl
from flaxlens.tools.base._sites import sites_of

X = jax.random.normal(jax.random.key(0), (2, 4))


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(4)(x)) + x, None


def _linen_scan(block):
  return nn.scan(
    block,
    variable_axes={"params": 0, "intermediates": 0},
    split_rngs={"params": True},
    length=3,
  )


LINEN_LIFTS = {
  "scan(remat)": lambda: _linen_scan(nn.remat(LinenBlock)),
  "remat(scan)": lambda: nn.remat(_linen_scan(LinenBlock)),
  "scan(remat(remat))": lambda: _linen_scan(nn.remat(nn.remat(LinenBlock))),
  "remat(scan(remat))": lambda: nn.remat(_linen_scan(nn.remat(LinenBlock))),
  "scan(jit)": lambda: _linen_scan(nn.jit(LinenBlock)),
}


class LinenStack(nn.Module):
  lift: str

  @nn.compact
  def __call__(self, x):
    x, _ = LINEN_LIFTS[self.lift]()(name="layers")(x, None)
    return nn.Dense(2)(x)


class NNXBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x)) + x


def _nnx_scan(f):
  return nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(f)


def _apply(block, x):
  return block(x)


NNX_LIFTS = {
  "scan(remat)": lambda: _nnx_scan(nnx.remat(_apply)),
  "remat(scan)": lambda: nnx.remat(_nnx_scan(_apply)),
  "scan(remat(remat))": lambda: _nnx_scan(nnx.remat(nnx.remat(_apply))),
  "remat(scan(remat))": lambda: nnx.remat(_nnx_scan(nnx.remat(_apply))),
  "scan(jit)": lambda: _nnx_scan(nnx.jit(_apply)),
}


class NNXStack(nnx.Module):
  def __init__(self, lift: str, rngs: nnx.Rngs):
    self.lift = lift

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return NNXBlock(rngs)

    self.blocks = blocks(rngs)
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(NNX_LIFTS[self.lift]()(self.blocks, x))


def _case(fw, lift):
  if fw is LINEN:
    module = LinenStack(lift)
    variables = dict(module.init(jax.random.key(1), X))
    return linen_corpus.Case(lift, module, variables, (X,))
  return nnx_corpus.Case(lift, NNXStack(lift, nnx.Rngs(1)), (X,))


def _native_key(site) -> tuple:
  return (*map(str, site.node.path), site.node.method_name)


@pytest.mark.parametrize("fw", list(FRAMEWORKS.values()))
@pytest.mark.parametrize("lift", list(LINEN_LIFTS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_each_call_in_a_composed_lift_is_one_site_captured_as_flax_captures_it(fw, lift, jit):
  case = _case(fw, lift)
  tree = fw.convert(case)
  out, cache = fl.capture(tree, X, jit=jit)
  native_out, native = fw.native_captures(case, jit=jit)
  assert_trees_equal(out, native_out)
  sites = sites_of(tree)
  assert sorted(cache) == sorted(s.name for s in sites)
  assert sorted(_native_key(s) for s in sites) == sorted(native)
  for site in sites:
    (value,) = native[_native_key(site)]
    assert_trees_equal(cache[site.name], value)
  inner = "layers/Dense_0" if fw is LINEN else "blocks/linear"
  assert cache[inner].shape == (3, 2, 4)
