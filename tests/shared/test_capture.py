"""Captures: `fl.capture` returns what Flax's own capture of method outputs returns.

Each corpus model runs once through `fl.capture` and once natively with Linen's
`capture_intermediates=True` or NNX's `nnx.capture(method_outputs=...)`; every call
both capture must be equal bit for bit, in the same compilation mode, and the outputs
too. Calls inside `nn.scan`/`nnx.scan` bodies come out stacked along the scan axis even
where the native model does not declare a collection for them.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from comparisons import assert_trees_equal
from frameworks import FRAMEWORKS

import flaxlens as fl
from flaxlens.tools.base._sites import sites_of


def _native_key(site, root) -> tuple:
  path, method = site.node.path, site.node.method_name
  return (*map(str, path), method if isinstance(method, str) else method.__name__)


# Models with calls inside an inner `nn.jit`/`nnx.jit`. A capturing run calls that body
# inline (documented: docs/interventions.md, README limits), so an eager capture runs it op by
# op where the native call runs it compiled, and XLA may round the two apart by an ulp
# (measured: dropout scaling on jax 0.10.0; bit for bit on jax 0.10.2). Compiled, both are one
# program and must be equal bit for bit.
_INNER_JIT = {"jit", "jit_method", "nnx_jit_inside"}


def _compare(fw, case, jit: bool) -> int:
  tree = fw.convert(case)
  argument = fw.argument(case)
  out, cache = fl.capture(tree, argument, jit=jit, **fw.side_inputs(case))
  try:
    native_out, native = fw.native_captures(case, jit=jit)
  except ValueError as e:  # nnx.capture cannot run models holding nnx.bridge modules.
    pytest.skip(f"Flax's own capture cannot run this model: {e}")
  assert_trees_equal(out, native_out)
  seen: dict[tuple, int] = {}
  compared = 0
  for site in sites_of(tree):
    key = _native_key(site, tree)
    index = seen.get(key, 0)
    seen[key] = index + 1
    values = native.get(key)
    if values is None or index >= len(values) or site.name not in cache:
      continue
    ours = jax.tree_util.tree_leaves(cache[site.name])
    theirs = jax.tree_util.tree_leaves(values[index])
    assert len(ours) == len(theirs), site.name
    for a, b in zip(ours, theirs, strict=True):
      if not jit and case.name in _INNER_JIT:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-7, err_msg=site.name)
      else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=site.name)
    compared += 1
  return compared


CASES = [(fw, name) for fw in FRAMEWORKS.values() for name in fw.corpus.NAMES]


@pytest.mark.parametrize(("fw", "name"), CASES)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_captured_calls_equal_flax_own_capture(corpora, fw, name, jit):
  case = corpora[fw][name]
  compared = _compare(fw, case, jit)
  # A root method given as a function is no module method that Flax's capture sees.
  assert compared >= 1 or not isinstance(case.method, str | None)
