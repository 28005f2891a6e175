"""Run in a subprocess by test_sharded.py: the graph of a model and transcoders sharded
over a 4-device CPU mesh equals the reference's (circuit-tracer's, as the unsharded graph
does in test_attribute.py). Prints `check: True|False` lines;
XLA_FLAGS must be set before JAX starts, hence the process."""

from __future__ import annotations

import os
import pathlib
import sys


def main() -> None:
  """Imports JAX only here, so that importing this file (doctest collection) is inert."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  sys.path.insert(0, str(pathlib.Path(__file__).parents[2]))
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import flaxlens as fl
  import flaxlens.graphs as flg
  from tests.graphs.reference import load_case

  case = load_case("clt_ln")
  mesh = Mesh(np.array(jax.devices()), ("x",))

  def sharded(x):
    axis = next((a for a in range(x.ndim - 1, -1, -1) if x.shape[a] % 4 == 0), None)
    spec = [None] * x.ndim
    if axis is not None:
      spec[axis] = "x"
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))

  expected = case.graphs["default"]
  variables = jax.tree.map(sharded, case.linen_variables)
  tree = fl.unflaxify(case.linen_model, variables, case.tokens)
  transcoders = case.transcoders
  nnx.update(transcoders, jax.tree.map(sharded, nnx.state(transcoders)))
  spread = {str(leaf.sharding.spec) for leaf in jax.tree.leaves(variables)}
  print(f"parameters sharded: {any('x' in s for s in spread)}")
  graph = flg.attribute(tree, case.tokens, transcoders, case.linen_mlp_sites)
  difference = float(np.abs(graph.adjacency - expected.adjacency_matrix).max())
  same = np.array_equal(graph.selected, expected.selected_features)
  print(f"graph equal: {same and difference <= 1e-5 * np.abs(expected.adjacency_matrix).max()}")
  print(f"graph max diff: {difference}")


if __name__ == "__main__":
  main()
