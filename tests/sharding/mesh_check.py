"""Run in a subprocess by test_mesh.py: a Linen MLP sharded over a 2x2 CPU mesh.

Prints one line per check; XLA_FLAGS must be set before JAX starts, hence the process.
"""

from __future__ import annotations

import os


def main() -> None:
  """Imports JAX only here, so that importing this file (doctest collection) is inert."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import flaxlens as fl

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.initializers.lecun_normal()
      x = nn.Dense(16, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
      return nn.Dense(8, kernel_init=nn.with_partitioning(init, ("model", None)))(nn.relu(x))

  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
  module, x = MLP(), jnp.ones((4, 8))
  variables = module.init(jax.random.key(0), x)
  shardings = jax.tree_util.tree_map(
    lambda spec: NamedSharding(mesh, spec), nn.get_partition_spec(variables)
  )
  variables = jax.device_put(nn.unbox(variables), shardings)
  x = jax.device_put(x, NamedSharding(mesh, P("data", None)))

  tree = fl.unflaxify(module, variables, x)
  kernel = tree.select().at_path("Dense_0").get().scope_data.parameters["kernel"].value
  print("buffers shared:", kernel is variables["params"]["Dense_0"]["kernel"])
  eager = tree(fl.ArgsAndKwargs.capture(x))
  native = module.apply(variables, x)
  print("eager exact:", bool(np.array_equal(eager, native)))
  print("eager sharding:", eager.sharding.is_equivalent_to(native.sharding, eager.ndim))
  jitted = fl.variable_jit(lambda t, x: t(fl.ArgsAndKwargs.capture(x)))(tree, x)
  native_jitted = jax.jit(module.apply)(variables, x)
  print("jit exact:", bool(np.array_equal(jitted, native_jitted)))
  print("jit sharding:", jitted.sharding.is_equivalent_to(native_jitted.sharding, jitted.ndim))
  print("isolate exact:", bool(fl.isolate(tree, x, "Dense_1").replay()))


if __name__ == "__main__":
  main()
