"""The one leaf-by-leaf comparison that replays, `fl.check_equivalence` and `fl.fold` report
through (`fl.EquivalenceReport`): structure, missing leaves, keys, infinities, integers.

Expected distances are computed here with Python integers and numpy, never by flaxlens.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from frameworks import LINEN, NNX

import flaxlens as fl


def _row(report, name):
  (row,) = [r for r in report.rows if r.name == name]
  return row


def test_a_leaf_on_one_side_only_is_a_row_that_differs():
  x = jnp.ones(3)
  report = fl.EquivalenceReport.compare({"a": x}, {"a": x, "b": x})
  assert not report
  row = _row(report, "output['b']")
  assert not row.bitwise and row.max_abs == math.inf and row.note == "only in b"
  assert _row(report, "output['a']").bitwise


def test_pytrees_of_another_structure_with_the_same_leaves_are_reported():
  x = jnp.ones(3)
  report = fl.EquivalenceReport.compare((x, x), [x, x])
  assert not report
  assert _row(report, "output structure").note == "other pytree types"


def test_prng_keys_of_different_implementations_differ_even_from_one_seed():
  a, b = jax.random.key(0, impl="threefry2x32"), jax.random.key(0, impl="rbg")
  report = fl.EquivalenceReport.compare(a, b)
  assert not report
  assert report.rows[0].note == "PRNG keys of different implementations"
  assert fl.EquivalenceReport.compare(a, jax.random.key(0, impl="threefry2x32"))


def test_infinities_of_one_sign_are_equal_where_other_elements_differ():
  a = np.array([np.inf, -np.inf, 1.0], np.float32)
  b = np.array([np.inf, -np.inf, 1.5], np.float32)
  report = fl.EquivalenceReport.compare(a, b)
  assert not report
  assert report.max_abs == 0.5 and report.max_rel == 0.5 / 1.5


@pytest.mark.parametrize(
  "dtype, a, b",
  [(np.int64, 2**62, -(2**62)), (np.uint64, 0, 2**64 - 1), (np.int8, -128, 127)],
  ids=["int64", "uint64", "int8"],
)
def test_integer_differences_are_exact_at_the_ends_of_their_range(dtype, a, b):
  report = fl.EquivalenceReport.compare(np.array([a], dtype), np.array([b], dtype))
  assert report.max_abs == float(abs(a - b))


@pytest.mark.parametrize(
  "fw, name, path",
  [(LINEN, "batchnorm_train", "BatchNorm_0"), (NNX, "convnet_train", "norm")],
)
def test_a_replay_reports_one_row_per_output_leaf_and_per_state_variable(corpora, fw, name, path):
  isolated = fw.isolate(corpora[fw][name], path)
  report = isolated.replay()
  assert isinstance(report, fl.EquivalenceReport) and report
  assert [r.name for r in report.outputs] == ["output"]
  assert sorted(r.name for r in report.state) == sorted(v.label for v in isolated.final_var_values)


@pytest.mark.parametrize(
  "fw, name, path",
  [(LINEN, "batchnorm_train", "BatchNorm_0"), (NNX, "convnet_train", "norm")],
)
def test_a_replay_names_a_state_variable_that_differs(corpora, fw, name, path):
  isolated = fw.isolate(corpora[fw][name], path)
  (first, *_) = isolated.final_var_values
  tampered = isolated.select().at(lambda i: i.final_var_values[0].value).apply(lambda v: v + 1)
  report = tampered.replay()
  assert not report
  assert [r.name for r in report.rows if not r.bitwise] == [first.label]
  assert _row(report, first.label).max_abs == pytest.approx(1.0)
