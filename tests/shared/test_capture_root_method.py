"""A tree converted for a method other than `__call__` captures each call once, as Flax.

Flax's `examples/wmt` decodes with `model.apply(..., method=Model.decode)`, where
`decode` calls submodules and another method of the model. Whether the method is given
by name, as the class's function or as a function taking the module, the root call is
one site and every other call is captured as Flax's own capture of every method
records it (Linen's `capture_intermediates` with a filter taking every method, NNX's
`nnx.capture(method_outputs=...)`), bit for bit.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import pytest
from comparisons import assert_trees_equal
from flax import nnx
from frameworks import FRAMEWORKS, LINEN
from linen import corpus as linen_corpus
from nnx import corpus as nnx_corpus

import flaxlens as fl

X = jax.random.normal(jax.random.key(0), (2, 5))


class LinenCodec(nn.Module):
  def setup(self):
    self.embed = nn.Dense(6)
    self.out = nn.Dense(3)

  def encode(self, x):
    return nn.relu(self.embed(x))

  def decode(self, x):
    return self.out(self.encode(x))

  def __call__(self, x):
    return self.decode(x)


class NNXCodec(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Linear(5, 6, rngs=rngs)
    self.out = nnx.Linear(6, 3, rngs=rngs)

  def encode(self, x):
    return nnx.relu(self.embed(x))

  def decode(self, x):
    return self.out(self.encode(x))

  def __call__(self, x):
    return self.decode(x)


FORMS = {
  "name": lambda cls: "decode",
  "function": lambda cls: cls.decode,
  "lambda": lambda cls: lambda module, x: module.decode(x),
}


def _case(fw, form):
  if fw is LINEN:
    module = LinenCodec()
    variables = dict(module.init(jax.random.key(1), X))
    return linen_corpus.Case("codec", module, variables, (X,), method=FORMS[form](LinenCodec))
  return nnx_corpus.Case("codec", NNXCodec(nnx.Rngs(1)), (X,), method=FORMS[form](NNXCodec))


def _site_names(native: dict, root_class: str) -> dict:
  """Flax's captures by the names flaxlens gives sites (`#k`: the k-th further call)."""
  named = {}
  for (*path, method), values in native.items():
    name = f"{root_class}.{method}" if not path else "/".join(path)
    if path and method != "__call__":
      name = f"{name}.{method}"
    for k, value in enumerate(values):
      named[f"{name}#{k}" if k else name] = value
  return named


@pytest.mark.parametrize("fw", list(FRAMEWORKS.values()))
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_each_call_of_a_method_is_captured_once_as_flax_captures_it(fw, form, jit):
  case = _case(fw, form)
  tree = fw.convert(case)
  out, cache = fl.capture(tree, X, jit=jit)
  native_out, native = fw.native_captures(case, jit=jit, every_method=True)
  root_class = "LinenCodec" if fw is LINEN else "NNXCodec"
  expected = _site_names(native, root_class)
  # A function taking the module is not a method Flax captures: the root is its output.
  method = "<lambda>" if form == "lambda" else "decode"
  expected.setdefault(f"{root_class}.{method}", native_out)
  assert sorted(cache) == sorted(expected)
  for name, value in expected.items():
    assert_trees_equal(cache[name], value)
  assert_trees_equal(out, native_out)
