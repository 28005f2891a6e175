"""What a harvest must not get wrong quietly: a complete store left byte for byte as it
was by the same call (even where it cannot be written), calls that differ only in a
Python number, a global or a `functools.partial` argument, a model that updates its
state resumed to the rows of an uninterrupted run (checked against the native NNX
model's own calls), damaged store files refused with `HarvestError` (and overwritten
on request), and small inputs that used to fail with raw errors."""

from __future__ import annotations

import functools
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxlens as fl

from . import models

BATCHES = models.token_batches(3)


def test_the_same_call_on_a_complete_store_changes_no_byte_of_it(linen_model, tmp_path):
  path = tmp_path / "s"
  fl.harvest(linen_model.tree, BATCHES, "Block_0", path)
  before = models.store_files(path)
  shape = json.loads(before["s0/values/zarr.json"])["shape"]
  assert shape[0] == len(fl.open_harvest(path)["Block_0"])  # other zarr readers: exact rows
  again = fl.harvest(linen_model.tree, BATCHES, "Block_0", path)
  assert again.complete and models.store_files(path) == before


def test_the_same_call_on_a_complete_store_that_cannot_be_written_returns_it(
  linen_model, tmp_path, monkeypatch
):
  path = tmp_path / "s"
  first = fl.harvest(linen_model.tree, BATCHES, "Block_0", path)

  def refuse(*args, **kwargs):
    raise PermissionError("read-only store")

  monkeypatch.setattr(fl.tools.harvest._store, "write_progress", refuse)
  monkeypatch.setattr(fl.tools.harvest._directory, "_check_writable", refuse)
  again = fl.harvest(linen_model.tree, BATCHES, "Block_0", path)
  np.testing.assert_array_equal(again["Block_0"][:], first["Block_0"][:])


class _Scaled(nnx.Module):
  def __init__(self):
    self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

  def __call__(self, x, scale):
    return self.linear(x) * scale


def test_a_python_number_in_the_batch_is_part_of_the_call(tmp_path):
  x = np.ones((2, 3, 4), np.float32)
  tree = fl.unflaxify(_Scaled(), x, 2.0)
  path = tmp_path / "s"
  fl.harvest(tree, [(x, 2.0)], "linear", path)
  before = models.store_files(path)
  with pytest.raises(fl.HarvestError, match="What differs: inputs"):
    fl.harvest(tree, [(x, 5.0)], "linear", path)
  assert models.store_files(path) == before


PAD_GLOBAL = models.PAD


def _not_global_pad(tokens):
  return tokens != PAD_GLOBAL


def _not_pad(tokens, *, pad):
  return tokens != pad


class _NotPad:
  def __init__(self, pad):
    self.pad = pad

  def __call__(self, tokens):
    return tokens != self.pad


def _change_global(value):
  global PAD_GLOBAL
  PAD_GLOBAL = value


@pytest.mark.parametrize(
  ("first", "second", "change"),
  [
    (_not_global_pad, _not_global_pad, lambda: _change_global(5)),
    (functools.partial(_not_pad, pad=0), functools.partial(_not_pad, pad=5), lambda: None),
    (_NotPad(0), _NotPad(5), lambda: None),
  ],
  ids=["global", "partial", "callable-object"],
)
def test_a_mask_computing_something_else_is_another_call(
  linen_model, tmp_path, first, second, change
):
  path = tmp_path / "s"
  fl.harvest(linen_model.tree, BATCHES, "Block_0", path, positions=first)
  before = models.store_files(path)
  try:
    change()
    with pytest.raises(fl.HarvestError, match="What differs: sites"):
      fl.harvest(linen_model.tree, BATCHES, "Block_0", path, positions=second)
  finally:
    _change_global(models.PAD)
  assert models.store_files(path) == before


class _Noisy(nnx.Module):
  """A model whose calls update its state: dropout in training mode (NNX random counts)."""

  def __init__(self):
    self.linear = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

  def __call__(self, x):
    return self.drop(self.linear(x))


def _stop_after(batches, count):
  for k, batch in enumerate(batches):
    if k == count:
      raise KeyboardInterrupt("stopped")
    yield batch


def test_a_model_that_updates_its_state_resumes_to_its_native_calls_in_order(tmp_path):
  rng = np.random.default_rng(0)
  batches = [rng.normal(size=(2, 3, 4)).astype(np.float32) for _ in range(5)]
  native_model = _Noisy()
  native = [np.asarray(native_model(x)).reshape(-1, 8) for x in batches]  # k-th call, k-th batch

  path = tmp_path / "s"
  with pytest.raises(KeyboardInterrupt):
    fl.harvest(fl.unflaxify(_Noisy(), batches[0]), _stop_after(batches, 3), "drop", path)
  assert not fl.open_harvest(path).complete
  # Resumed as a new process would: a tree converted afresh, its state that of the start.
  resumed = fl.harvest(fl.unflaxify(_Noisy(), batches[0]), batches, "drop", path)
  assert resumed.complete
  np.testing.assert_array_equal(resumed["drop"][:], np.concatenate(native))


def test_a_budget_that_would_split_a_model_updating_its_state_is_refused(tmp_path):
  x = np.ones((8, 3, 4), np.float32)
  tree = fl.unflaxify(_Noisy(), x)
  with pytest.raises(fl.BudgetError, match="updates the state variables"):
    fl.harvest(tree, [x], "drop", tmp_path / "s", budget=1024)
  assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
  ("file", "damage", "message"),
  [
    ("progress.json", lambda text: text[: len(text) // 2], "corrupted or truncated"),
    ("progress.json", lambda text: "[]", "malformed"),
    ("progress.json", lambda text: text.replace('"rows"', '"rowz"'), "malformed"),
    ("zarr.json", lambda text: text.replace('"sites"', '"sitez"'), "malformed"),
    ("zarr.json", lambda text: text.replace('"group": "s0"', '"group": "../x"'), "malformed"),
    ("s0/values/zarr.json", lambda text: "garbage", "cannot be opened"),
  ],
  ids=["truncated", "list", "no-rows", "no-sites", "group-outside", "array"],
)
def test_a_damaged_store_is_refused_and_overwritten_on_request(
  linen_model, tmp_path, file, damage, message
):
  path = tmp_path / "s"
  fl.harvest(linen_model.tree, BATCHES, "Block_0", path)
  target = path / file
  target.write_text(damage(target.read_text()))
  with pytest.raises(fl.HarvestError, match=message):
    fl.open_harvest(path)
  with pytest.raises(fl.HarvestError, match=f"{message}.*Nothing was overwritten"):
    fl.harvest(linen_model.tree, BATCHES, "Block_0", path)
  again = fl.harvest(linen_model.tree, BATCHES, "Block_0", path, overwrite=True)
  assert again.complete and len(again) == 9


def test_progress_counting_more_rows_than_the_arrays_hold_is_refused(linen_model, tmp_path):
  path = tmp_path / "s"
  fl.harvest(linen_model.tree, BATCHES, "Block_0", path)
  progress = json.loads((path / "progress.json").read_text())
  progress["rows"]["Block_0"] += 1
  (path / "progress.json").write_text(json.dumps(progress))
  with pytest.raises(fl.HarvestError, match="hold fewer"):
    fl.open_harvest(path)


def test_empty_selections_read_no_rows_as_numpy_does(linen_model, tmp_path):
  stored = fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "s")["Block_0"]
  rows = np.arange(len(stored))
  for key in (slice(10, 5), slice(-1, 0), slice(len(stored) + 5, len(stored)), []):
    assert stored[key].shape == (len(rows[key]), models.WIDTH)


def test_a_site_whose_rows_hold_no_value_is_refused_and_nothing_is_left(tmp_path):
  class Cut(nnx.Module):
    def __call__(self, x):
      return x[..., :0]

  class Empty(nnx.Module):
    def __init__(self):
      self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
      self.cut = Cut()

    def __call__(self, x):
      return self.cut(self.linear(x))

  x = np.ones((2, 3, 4), np.float32)
  tree = fl.unflaxify(Empty(), x)
  with pytest.raises(fl.ArgumentError, match="holds no value"):
    fl.harvest(tree, [x], "cut", tmp_path / "s")
  assert os.listdir(tmp_path) == []


def test_a_store_is_created_whole_or_not_at_all(linen_model, tmp_path, monkeypatch):
  store = fl.tools.harvest._store
  writes = store._write_json

  def failing(path, value, sync=True):
    if os.path.basename(path) == "zarr.json" and "attributes" in value:
      if store.GROUP_KEY in value["attributes"]:
        raise OSError("disk full")
    writes(path, value, sync)

  monkeypatch.setattr(store, "_write_json", failing)
  with pytest.raises(fl.HarvestError, match="disk full"):
    fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "s")
  assert os.listdir(tmp_path) == []  # neither the store nor its temporary directory
  monkeypatch.setattr(store, "_write_json", writes)
  assert fl.harvest(linen_model.tree, BATCHES, "Block_0", tmp_path / "s").complete


def test_ids_that_are_no_integers_are_refused(linen_model, tmp_path):
  with pytest.raises(fl.ArgumentError, match="ids are integers"):
    fl.harvest(
      linen_model.tree, BATCHES, "Block_0", tmp_path / "s", ids=lambda t: t.astype(jnp.float32)
    )


def test_the_last_position_of_a_batch_without_positions_is_refused(linen_model, tmp_path):
  empty = np.zeros((2, 0), np.int32)
  with pytest.raises(fl.ArgumentError, match="this batch has none"):
    fl.harvest(linen_model.tree, [empty], "Block_0", tmp_path / "s", positions="last")


def test_an_iterable_whose_length_is_unknown_is_harvested(linen_model, tmp_path):
  class Unknown:
    """As tf.data's datasets of unknown cardinality: `len` raises."""

    def __iter__(self):
      return iter(BATCHES)

    def __len__(self):
      raise TypeError("The dataset length is unknown.")

  stored = fl.harvest(linen_model.tree, Unknown(), "Block_0", tmp_path / "s")
  assert stored.complete and len(stored) == 9
