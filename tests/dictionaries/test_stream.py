"""fld.stream: the rows it yields are the sites' values as fl.capture and fl.harvest give
them (bit for bit, as a multiset: the buffer shuffles), paired input to target, for an
SAE, a transcoder (a call's input to its output) and a CLT's layers."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import flaxlens as fl
import flaxlens.dictionaries as fld

from .toy_lms import VOCAB, ToyLM


@pytest.fixture(scope="module", params=["linen", "nnx"])
def lm(request):
  return ToyLM(request.param)


@pytest.fixture(scope="module")
def tree(lm):
  return lm.tree()


@pytest.fixture(scope="module")
def linen():
  """For what does not depend on the framework (the buffer, the options): the Linen toy
  LM and its tree."""
  lm = ToyLM("linen")
  return lm, lm.tree()


def _inputs(count=3):
  return [jax.random.randint(jax.random.key(10 + i), (2, 5), 0, VOCAB) for i in range(count)]


def _all_rows(data, batch_size, seed=0):
  batches = list(data.batches(batch_size, seed=seed))
  return np.concatenate([b.inputs for b in batches]), np.concatenate([b.targets for b in batches])


def _sorted_rows(*columns):
  """Rows of the columns side by side, in lexicographic order (a multiset to compare)."""
  rows = np.concatenate([c.reshape(len(c), -1) for c in columns], axis=1)
  return rows[np.lexsort(rows.T[::-1])]


def test_sae_rows_are_the_captured_rows(lm, tree):
  site = lm.block.format(0)
  data = fld.stream(tree, _inputs(), site, buffer=8)
  assert (data.d_in, data.d_out, data.layers, data.reads, data.writes) == (
    8,
    8,
    1,
    (site,),
    (site,),
  )
  inputs, targets = _all_rows(data, 4)
  captured = np.concatenate([np.asarray(fl.capture(tree, x, site)[1][site]) for x in _inputs()])
  expected = captured.reshape(-1, 8)
  assert inputs.shape == (30, 8)
  np.testing.assert_array_equal(inputs, targets)
  np.testing.assert_array_equal(_sorted_rows(inputs), _sorted_rows(expected))


def test_transcoder_rows_pair_a_calls_input_with_its_output(lm, tree):
  site = lm.mlp.format(1)
  data = fld.stream(tree, _inputs(), site, site, on="input", buffer=16)
  assert data.reads == (f"{site}:input",) and data.writes == (site,)
  inputs, targets = _all_rows(data, 5)
  ins, outs = [], []
  for x in _inputs():
    _, cache = fl.capture(tree, x, site, inputs=True)
    ins.append(np.asarray(cache[f"{site}:input"]).reshape(-1, 8))
    outs.append(np.asarray(cache[site]).reshape(-1, 8))
  np.testing.assert_array_equal(
    _sorted_rows(inputs, targets), _sorted_rows(np.concatenate(ins), np.concatenate(outs))
  )


def test_clt_rows_stack_the_layers(lm, tree):
  reads = [lm.mlp.format(layer) for layer in range(2)]
  data = fld.stream(tree, _inputs(2), reads, reads, on="input", buffer=6)
  assert data.layers == 2 and data.d_in == data.d_out == 8
  inputs, targets = _all_rows(data, 3)
  assert inputs.shape == targets.shape == (20, 2, 8)
  expected_in, expected_out = [], []
  for x in _inputs(2):
    _, cache = fl.capture(tree, x, reads, inputs=True)
    expected_in.append(np.stack([cache[f"{r}:input"] for r in reads], axis=2).reshape(-1, 2, 8))
    expected_out.append(np.stack([cache[r] for r in reads], axis=2).reshape(-1, 2, 8))
  np.testing.assert_array_equal(
    _sorted_rows(inputs, targets),
    _sorted_rows(np.concatenate(expected_in), np.concatenate(expected_out)),
  )


def test_a_mask_keeps_its_positions_and_last_the_last(linen):
  lm, tree = linen
  site = lm.block.format(1)
  xs = _inputs()
  masked = fld.stream(tree, xs, site, positions=lambda tokens: tokens % 2 == 0, buffer=7)
  inputs, _ = _all_rows(masked, 3)
  captured = [np.asarray(fl.capture(tree, x, site)[1][site]) for x in xs]
  expected = np.concatenate([c[np.asarray(x) % 2 == 0] for c, x in zip(captured, xs, strict=True)])
  np.testing.assert_array_equal(_sorted_rows(inputs), _sorted_rows(expected))
  last, _ = _all_rows(fld.stream(tree, xs, site, positions="last", buffer=4), 2)
  np.testing.assert_array_equal(
    _sorted_rows(last), _sorted_rows(np.concatenate([c[:, -1] for c in captured]))
  )


def test_rows_equal_a_harvests_rows(linen, tmp_path):
  lm, tree = linen
  site = lm.block.format(0)
  stored = fl.harvest(tree, _inputs(), site, str(tmp_path / "store"), progress=False)
  inputs, _ = _all_rows(fld.stream(tree, _inputs(), site, buffer=10), 10)
  np.testing.assert_array_equal(_sorted_rows(inputs), _sorted_rows(stored[site][:]))


def test_batches_are_shuffled_by_seed_across_inputs(linen):
  lm, tree = linen
  site = lm.block.format(0)
  data = fld.stream(tree, _inputs(), site, buffer=30, dtype="bfloat16")
  first = list(data.batches(10, seed=3))
  again = list(data.batches(10, seed=3))
  other = list(data.batches(10, seed=4))
  assert first[0].inputs.dtype == np.dtype("bfloat16")
  assert all((a.inputs == b.inputs).all() for a, b in zip(first, again, strict=True))
  assert any((a.inputs != b.inputs).any() for a, b in zip(first, other, strict=True))
  # With a buffer of every row, a batch mixes the three inputs' rows.
  by_input = [np.asarray(fl.capture(tree, x, site)[1][site]).reshape(-1, 8) for x in _inputs()]
  sources = {
    i for row in first[0].inputs.astype(np.float32) for i, rows in enumerate(by_input)
    if (rows.astype("bfloat16").astype(np.float32) == row).all(1).any()
  }  # fmt: skip
  assert len(sources) > 1


def test_a_function_gives_each_epochs_inputs(linen):
  lm, tree = linen
  data = fld.stream(tree, lambda: iter(_inputs(2)), lm.block.format(0), buffer=20)
  assert sum(len(b.inputs) for b in data.batches(6, seed=0)) == 20
  assert sum(len(b.inputs) for b in data.batches(6, seed=1)) == 20


def test_refusals(linen):
  lm, tree = linen
  site = lm.block.format(0)
  with pytest.raises(fl.ArgumentError, match="iterate afresh"):
    fld.stream(tree, iter(_inputs()), site)
  with pytest.raises(fl.ArgumentError, match="names 2 calls"):
    fld.stream(tree, _inputs(), lm.block.format("*"))
  with pytest.raises(fl.ArgumentError, match="lists of the same length"):
    fld.stream(tree, _inputs(), [site], site)
  with pytest.raises(fl.ArgumentError, match="larger than the stream's buffer"):
    next(fld.stream(tree, _inputs(), site, buffer=4).batches(5, seed=0))
  with pytest.raises(fl.ArgumentError, match="positions="):
    fld.stream(tree, _inputs(), site, positions="first")
  with pytest.raises(fl.ArgumentError, match=r"\(batch, d\)"):
    fld.stream(tree, _inputs(), site, positions=None)
