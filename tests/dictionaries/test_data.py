"""Training data: `from_harvest` pairs a store's sites row for row (a transcoder's input and
output, a CLT's layers stacked) as Flax computed them; `from_arrays` passes every row once
per epoch; sites the store lacks and rows that do not pair are refused."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlens as fl
import flaxlens.dictionaries as fld


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    hidden = nn.Dense(6, name="up")(x)
    return nn.Dense(4, name="down")(nn.relu(hidden))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
  model, x = Mlp(), jax.random.normal(jax.random.key(0), (3, 5, 4))
  variables = model.init(jax.random.key(1), x)
  tree = fl.unflaxify(model, variables, x)
  sites = ["up", "down"]
  harvest = fl.harvest(tree, [x, x + 1], sites, str(tmp_path_factory.mktemp("s") / "store"),
                       progress=False)  # fmt: skip
  _, native = model.apply(variables, jnp.concatenate([x, x + 1]), capture_intermediates=True)
  return harvest, {name: np.asarray(native["intermediates"][name]["__call__"][0]) for name in sites}


def _sorted_rows(array: np.ndarray) -> np.ndarray:
  flat = array.reshape(-1, array.shape[-1])
  return flat[np.lexsort(flat.T[::-1])]


def test_from_harvest_pairs_the_input_and_output_sites_row_for_row(store):
  harvest, native = store
  data = fld.from_harvest(harvest, "up", "down")
  assert (data.d_in, data.d_out, data.layers) == (6, 4, 1)
  batches = list(data.batches(7, seed=3))
  inputs = np.concatenate([b.inputs for b in batches])
  targets = np.concatenate([b.targets for b in batches])
  pairs = np.concatenate([inputs, targets], axis=1)
  expected = np.concatenate([native["up"], native["down"]], axis=-1)
  np.testing.assert_array_equal(_sorted_rows(pairs), _sorted_rows(expected))


def test_from_harvest_stacks_a_clts_layers_on_axis_one(store):
  harvest, native = store
  data = fld.from_harvest(harvest, ["down", "down"], ["down", "down"])
  rows = next(data.batches(30, seed=0)).inputs
  assert rows.shape == (30, 2, 4) and np.array_equal(rows[:, 0], rows[:, 1])


def test_a_site_the_harvest_does_not_hold_is_refused_with_its_sites(store):
  harvest, _ = store
  with pytest.raises(fl.HarvestError, match=r"reads= names \['mlp'\].*its sites: \['up', 'down'\]"):
    fld.from_harvest(harvest, "mlp")
  with pytest.raises(fl.ArgumentError, match="reads has 1 sites and writes 2"):
    fld.from_harvest(harvest, "up", ["down", "down"])


def test_a_dictionary_for_another_site_is_refused_naming_the_sites(store):
  from flax import nnx

  harvest, _ = store
  sae = fld.SAE(4, 8, rngs=nnx.Rngs(0))
  with pytest.raises(fl.ArgumentError, match=r"d_in is 4 in the dictionary but 6 .*\['up'\]"):
    fld.train(sae, fld.from_harvest(harvest, "up"), steps=1, batch_size=4, progress=False)


def test_from_arrays_gives_every_row_once_per_epoch_in_full_batches():
  rows = np.arange(30, dtype=np.float32).reshape(10, 3)
  data = fld.from_arrays(rows)
  batches = list(data.batches(4, seed=1))
  assert [len(b.inputs) for b in batches] == [4, 4]
  seen = np.concatenate([b.inputs for b in batches])
  assert len(np.unique(seen[:, 0])) == 8 and all(b.targets is not None for b in batches)
  with pytest.raises(fl.ArgumentError, match="differ in rows"):
    fld.from_arrays(rows, rows[:5])
