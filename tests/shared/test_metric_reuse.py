"""A metric that is a new function object reuses the compiled program; counting compiles.

`fl.sweep`, `fl.attribute` and `fl.grad_at` key their program on what the metric
computes: its code and the values it closes over. A new `lambda` with the same code and
values traces nothing (`fl.count_compiles`), a new array it closes over is an input (its
values are read, not baked), and another Python number traces again with one
`fl.MetricRetraceWarning` naming `metric=` and the variable. Values are checked against
the native model's output: a sweep with clean == corrupted patches nothing (every row is
the metric of the native output), an attribution then estimates zero change, and
`grad_at`'s value is the metric of the native output.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from frameworks import LINEN, NNX

import flaxlens as fl

SETTINGS = {"linen": ("transformer", "TransformerBlock_1"), "nnx": ("list", "layers/1")}
TOOLS = ("sweep", "attribute", "grad_at")


def _setting(framework, corpora):
  name, site = SETTINGS[framework.name]
  case = corpora[framework][name]
  native, _ = framework.native(case, jit=True)
  return framework.convert(case), case.args, site, native


def _ask(tool, tree, args, site, metric):
  """The tool's answer with clean == corrupted, as an array."""
  if tool == "grad_at":
    return fl.grad_at(tree, args, site, metric)[0]
  return getattr(fl, tool)(tree, args, args, site, metric).values


def _expected(tool, metric, native):
  if tool == "attribute":  # (clean - corrupted) * gradient, with clean == corrupted.
    return np.zeros(1)
  return np.reshape(metric(native), -1)


def _picking(k):
  """A new metric object each call, always of the same code."""
  return lambda out: out.reshape(-1)[k] * 2.0


_lines = itertools.count(1)


def _new(source):
  """The function `source` defines, with code new to this process (the warning is given
  once per code and tool): compiled at a line number of its own, as code objects are
  compared by their line numbers too."""
  return eval(compile("\n" * next(_lines) + source, __file__, "eval"))


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_a_new_metric_with_the_same_code_and_values_compiles_nothing(framework, tool, corpora):
  tree, args, site, native = _setting(framework, corpora)
  _ask(tool, tree, args, site, _picking(3))
  with fl.count_compiles() as count:
    value = _ask(tool, tree, args, site, _picking(3))
  assert (count.traces, count.requests) == (0, 0)
  np.testing.assert_allclose(value, _expected(tool, _picking(3), native), rtol=1e-6, atol=1e-6)


def _weighted(out, *, weights):
  return (out * weights).sum()


WEIGHTINGS = {
  "lambda": lambda w: lambda out: (out * w).sum(),
  "default": lambda w: lambda out, w=w: (out * w).sum(),
  "partial": lambda w: functools.partial(_weighted, weights=w),
}


@pytest.mark.parametrize("form", WEIGHTINGS)
@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_a_metric_closing_over_a_new_array_compiles_nothing_and_reads_it(framework, form, corpora):
  tree, args, site, native = _setting(framework, corpora)
  weights = [jax.random.normal(jax.random.key(k), native.shape) for k in range(3)]
  traced = []
  for w in weights:
    with fl.count_compiles() as count:
      value, _ = fl.grad_at(tree, args, site, WEIGHTINGS[form](w))
    traced.append(count.traces)
    np.testing.assert_allclose(value, (native * w).sum(), rtol=1e-5, atol=1e-5)
  assert traced[1:] == [0, 0]


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_a_metric_closing_over_another_number_traces_again_and_warns_once(framework, corpora):
  tree, args, site, native = _setting(framework, corpora)

  picking = _new("lambda k: lambda out: out.reshape(-1)[k] * 2.0")
  fl.grad_at(tree, args, site, picking(0))
  for k, warns in [(1, True), (2, False)]:
    with fl.count_compiles() as count, warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      value, _ = fl.grad_at(tree, args, site, picking(k))
    assert count.traces == 1
    retraces = [w for w in caught if issubclass(w.category, fl.MetricRetraceWarning)]
    assert len(retraces) == warns
    if warns:
      message = str(retraces[0].message)
      assert "fl.grad_at: metric=" in message and "closure variable 'k'" in message
      assert retraces[0].filename == __file__  # Points at the caller's line.
    np.testing.assert_allclose(value, native.reshape(-1)[k] * 2.0, rtol=1e-6)


@pytest.mark.parametrize("tool", ("sweep", "grad_at"))
@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_a_metric_reading_a_global_that_changes_gets_its_new_value(framework, tool, corpora):
  """A lambda written in a loop at a module's top level reads the loop variable as a
  global: each value must give its own program (the program bakes in what it read)."""
  tree, args, site, native = _setting(framework, corpora)
  namespace = {"picked": {"at": 0}}
  code = compile(
    "\n" * next(_lines) + "lambda out: out.reshape(-1)[k + picked['at']] * 2.0", __file__, "eval"
  )
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", fl.MetricRetraceWarning)
    for k, at in [(0, 0), (1, 0), (2, 0), (2, 3)]:  # a global number, then a dict in place
      namespace["k"] = k
      namespace["picked"]["at"] = at
      value = _ask(tool, tree, args, site, eval(code, namespace))
      np.testing.assert_allclose(value, native.reshape(-1)[k + at] * 2.0, rtol=1e-6)


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_a_metric_needing_the_value_of_an_array_it_closes_over_gets_it(framework, corpora):
  tree, args, site, native = _setting(framework, corpora)
  slicing = _new("lambda n: lambda out: out.reshape(-1)[:n].sum()")
  for n in (np.int32(3), np.int32(5)):  # A slice bound: it must be known when traced.
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      value, _ = fl.grad_at(tree, args, site, slicing(n))
    np.testing.assert_allclose(value, native.reshape(-1)[:n].sum(), rtol=1e-6)
    # Its values are baked in: another value is another program, and says so.
    warned = [str(w.message) for w in caught if w.category is fl.MetricRetraceWarning]
    assert len(warned) == (n == 5) and all("closure variable 'n'" in w for w in warned)


@pytest.mark.parametrize("framework", [LINEN, NNX])
def test_count_compiles_counts_one_trace_and_one_compilation_for_a_new_question(framework, corpora):
  tree, args, _, native = _setting(framework, corpora)
  jax.clear_caches()  # So that this process has not compiled the question yet.
  # Made outside the block: making one converts its float with an eager JAX call.
  scalings = [fl.scale(framework.module_class(tree), float(a)) for a in range(4)]
  with fl.count_compiles() as count:
    outputs = [fl.run(tree, args, interventions=[scaling]) for scaling in scalings]
  assert (count.traces, count.compilations, count.cache_hits) == (1, 1, 0)
  for a, output in enumerate(outputs):
    np.testing.assert_allclose(output, native * a, rtol=1e-6)


def test_count_compiles_counts_nothing_outside_its_block():
  with fl.count_compiles() as count:
    pass
  jax.jit(lambda x: x - 7)(jnp.arange(3.0))
  assert (count.traces, count.requests) == (0, 0)
