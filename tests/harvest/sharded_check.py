"""Run in a subprocess with four CPU devices: a harvest of batches sharded over a mesh's
batch axis writes each device's rows from its own shard, and the rows equal `fl.capture`
of the same batches. Prints `check: True/False` lines."""

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
from flaxlens.tools.harvest import _harvest  # noqa: E402
from harvest import models  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("batch",))
sharding = NamedSharding(mesh, PartitionSpec("batch"))
model = models.build("linen")
batches = [jax.device_put(b, sharding) for b in models.token_batches(3, size=4)]
pieces = []
original = _harvest._pieces


def counted(array, count):
  found = original(array, count)
  pieces.append(len(found))
  return found


_harvest._pieces = counted
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
