"""Run in a subprocess with four CPU devices: a harvest of batches sharded over a mesh's
batch axis writes each device's rows from its own shard, and the rows equal `fl.capture`
of the same batches; host batches placed by `sharding=` and a mask keep each device's rows
on it, and the store equals a harvest on one device. Prints `check: True/False` lines."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flaxlens as fl  # noqa: E402
from flaxlens.tools.harvest import _writing  # noqa: E402
from harvest import models  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("batch",))
sharding = NamedSharding(mesh, PartitionSpec("batch"))
model = models.build("linen")
batches = [jax.device_put(b, sharding) for b in models.token_batches(3, size=4)]
pieces = []
mask_examples = []  # the examples of each piece of a mask's index rows
original = _writing.pieces


def counted(array, counts):
  found = original(array, counts)
  pieces.append(len(found))
  if counts is not None:
    mask_examples.extend(set(data[:, 0].tolist()) for _, _, data in found if data.shape[1:] == (2,))
  return found


_writing.pieces = counted
stored = fl.harvest(model.tree, batches, model.sites, tempfile.mkdtemp() + "/s")
print(f"devices: {len(jax.devices()) == 4}")
print(f"written shard by shard: {max(pieces) == 4}")
exact = all(
  np.array_equal(
    stored[site][:],
    np.concatenate(
      [
        np.asarray(fl.capture(model.tree, b, site)[1][site]).reshape(-1, models.WIDTH)
        for b in batches
      ]
    ),
  )
  for site in model.sites
)
print(f"rows exact: {exact}")

options = {
  "positions": {model.sites[0]: "all", "**": models.not_padding},
  "ids": models.token_ids,
  "progress": False,
}
host = models.token_batches(3, size=4, seed=2)
pieces.clear()
meshed = fl.harvest(
  model.tree, host, model.sites, tempfile.mkdtemp() + "/m", sharding=sharding, **options
)
print(f"mask written shard by shard: {max(pieces) == 4}")
# One example per device: each piece of a mask's rows holds the rows of one example.
print(f"mask rows stay on their device: {all(len(found) == 1 for found in mask_examples)}")
one = fl.harvest(model.tree, host, model.sites, tempfile.mkdtemp() + "/o", **options)
same = len(meshed) == len(one) and all(
  np.array_equal(got, expected)
  for site in model.sites
  for got, expected in [
    (meshed[site][:].view(np.uint8), one[site][:].view(np.uint8)),
    (meshed[site].index[:], one[site].index[:]),
    (meshed[site].ids[:], one[site].ids[:]),
  ]
)
print(f"mask rows equal one device: {same}")
