"""`fl.check_equivalence`: trees, plain models and exported models compared on one call.

Reports are checked against what is known of the two sides: the same model (bitwise),
a parameter moved by a tiny amount (close, not bitwise, the moved leaf named), another
model (far apart).
"""

from __future__ import annotations

import flax.errors
import jax
import numpy as np
import pytest
from comparisons import assert_trees_equal
from frameworks import LINEN, NNX

import flaxlens as fl

CASES = [
  (fw, name)
  for fw, names in (
    (LINEN, ("mlp", "batchnorm_train", "dropout", "scan", "logically_partitioned_scan")),
    (NNX, ("mlp", "convnet_train", "scan", "variable_metadata", "rngs_argument")),
  )
  for name in names
]
BOTH = [LINEN, NNX]
KERNEL = {LINEN: "params:Dense_0/kernel", NNX: "Param:hidden/kernel"}


def _check(fw, case, a, b):
  argument, options = fw.equivalence_call(case)
  return fl.check_equivalence(a, b, argument, **options)


def _value(tree, label):
  (variable,) = [v for v in fl.variables_in(tree) if v.label == label]
  return variable.value


def _nudge(tree, label, amount):
  (variable,) = [v for v in fl.variables_in(tree) if v.label == label]
  variable.value = variable.value + amount


@pytest.mark.parametrize("fw, name", CASES)
def test_a_tree_is_bitwise_equivalent_to_its_model(corpora, fw, name):
  case = corpora[fw][name]
  report = _check(fw, case, fw.plain_model(case), fw.convert(case))
  assert report, str(report)
  assert report.outputs and report.state


@pytest.mark.parametrize("fw, name", CASES)
def test_an_exported_tree_is_bitwise_equivalent_to_the_tree(corpora, fw, name):
  case = corpora[fw][name]
  tree = fw.convert(case)
  _nudge(tree, KERNEL[fw], 1.0) if name == "mlp" else None
  exported = fw.plain_model(fw.with_exported(case, fw.export(tree)))
  assert _check(fw, case, tree, exported)


@pytest.mark.parametrize("fw", BOTH)
def test_a_nudged_parameter_is_close_but_not_bitwise_and_is_named(corpora, fw):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  before = np.asarray(fw.model_state(case)[KERNEL[fw]], np.float64)
  _nudge(tree, KERNEL[fw], 1e-6)
  after = np.asarray(_value(tree, KERNEL[fw]), np.float64)
  report = _check(fw, case, fw.plain_model(case), tree)
  assert not report and not report.bitwise
  assert 0 < report.max_abs < 1e-4
  assert report.close(atol=1e-4) and not report.close(atol=1e-9)
  (kernel,) = [r for r in report.state if r.name == KERNEL[fw]]
  assert not kernel.bitwise and kernel.max_abs == np.max(np.abs(after - before))
  assert all(r.bitwise for r in report.state if r.name != KERNEL[fw])


@pytest.mark.parametrize("fw", BOTH)
def test_another_model_is_far_and_its_differences_are_measured(corpora, fw):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  for v in fl.variables_in(tree):
    v.value = jax.tree_util.tree_map(lambda a: -a, v.value)
  report = _check(fw, case, fw.plain_model(case), tree)
  (output,) = report.outputs
  native = np.asarray(fw.native(case)[0], np.float64)
  ours = np.asarray(fw.call(tree, case), np.float64)
  assert output.max_abs == np.max(np.abs(native - ours))
  assert not report.close(atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("fw", BOTH)
def test_checking_modifies_neither_side(corpora, fw):
  case = corpora[fw]["batchnorm_train" if fw is LINEN else "convnet_train"]
  tree = fw.convert(case)
  before_tree, before_model = fw.tree_state(tree), fw.model_state(case)
  _check(fw, case, fw.plain_model(case), tree)
  assert_trees_equal(fw.tree_state(tree), before_tree)
  assert_trees_equal(fw.model_state(case), before_model)


@pytest.mark.parametrize("fw", BOTH)
def test_the_printed_report_has_a_row_per_leaf_and_a_verdict(corpora, fw):
  case = corpora[fw]["mlp"]
  tree = fw.convert(case)
  _nudge(tree, KERNEL[fw], 0.5)
  text = str(_check(fw, case, fw.plain_model(case), tree))
  lines = text.splitlines()
  assert lines[2].split() == ["leaf", "bitwise", "max", "abs", "max", "rel"]
  (row,) = [line for line in lines if line.startswith(KERNEL[fw])]
  assert row.split()[1:3] == ["NO", "0.5"]
  assert lines[-1].startswith("NOT bitwise equal")


def test_a_state_on_one_side_only_is_reported_missing(corpora):
  case = corpora[LINEN]["batchnorm_eval"]
  argument, options = LINEN.equivalence_call(case)
  report = fl.check_equivalence(
    LINEN.plain_model(case), LINEN.convert(case), argument, **{**options, "mutable": False}
  )
  missing = [r for r in report.state if r.note == "only in b"]
  assert missing and all(r.name.startswith("batch_stats:") for r in missing)
  assert not report


def test_a_linen_module_without_variables_is_refused(corpora):
  case = corpora[LINEN]["mlp"]
  with pytest.raises(fl.ArgumentError, match=r"MLP: .* pass the pair \(module, variables\)"):
    fl.check_equivalence(case.module, LINEN.convert(case), case.args)


def test_a_random_stream_gives_both_sides_its_next_key_and_is_not_advanced(corpora):
  case = corpora[LINEN]["dropout"]
  argument, options = LINEN.equivalence_call(case)
  (name,) = case.rngs
  stream = fl.RandomStream.from_base_key(jax.random.key(5))
  options = {**options, "random_streams": {name: stream}}
  tree = LINEN.convert(case)
  assert fl.check_equivalence(tree, tree, argument, **options)
  assert fl.check_equivalence(tree, LINEN.plain_model(case), argument, **options)
  assert int(stream.offset.value) == 0
  # The key drawn is the stream's next one: the model's own output with that key.
  keys = {name: jax.random.fold_in(jax.random.key(5), 0)}
  other = {**options, "random_streams": keys}
  assert fl.check_equivalence(tree, LINEN.plain_model(case), argument, **other)


def test_a_plain_linen_side_without_mutable_fails_as_a_model_call_naming_the_fix(corpora):
  case = corpora[LINEN]["batchnorm_train"]
  argument, options = LINEN.equivalence_call(case)
  options = {**options, "mutable": False}
  with pytest.raises(fl.ModelCallError, match=r"side a \(Linen .*mutable=\['batch_stats'\]") as e:
    fl.check_equivalence(LINEN.plain_model(case), LINEN.convert(case), argument, **options)
  assert isinstance(e.value, flax.errors.ModifyScopeVariableError)


@pytest.mark.parametrize("fw", BOTH)
def test_a_plain_side_failing_on_its_input_is_a_model_call_error_naming_the_side(corpora, fw):
  case = corpora[fw]["mlp"]
  _, options = fw.equivalence_call(case)
  bad = fl.ArgsAndKwargs.capture(np.ones((2, 5), np.float32))  # Features of another size.
  with pytest.raises(fl.ModelCallError, match=r"fl.check_equivalence: side a .* Check that") as e:
    fl.check_equivalence(fw.plain_model(case), fw.plain_model(case), bad, **options)
  assert isinstance(e.value, type(e.value.__cause__))  # `except` of Flax's class catches it.
