"""Run in a subprocess by test_mesh_2x4.py: Linen and NNX models sharded over a 2x4 CPU mesh.

Linen: a model whose parameters carry logical axis names (`nn.with_logical_partitioning`)
mapped to the mesh by `nn.logical_axis_rules`, initialised sharded under `jax.jit`. NNX:
a model whose variables carry `sharding_names`, created under `nnx.jit` in a mesh
context. Prints one `check: True|False` line per check (and `...max diff: x` where a
value is informative); XLA_FLAGS must be set before JAX starts, hence the process.
"""

from __future__ import annotations

import os


def main() -> None:
  """Imports JAX only here, so that importing this file (doctest collection) is inert."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import flax.linen as nn
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import flaxlens as fl

  def bits_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
      x.dtype == y.dtype
      and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
      for x, y in zip(la, lb, strict=True)
    )

  def same_sharding(a, b):
    return all(
      x.sharding.is_equivalent_to(y.sharding, x.ndim)
      for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )

  def same_arrays(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(x is y for x, y in zip(la, lb, strict=True))

  def nnx_variables(model):
    """`{path: (variable type, metadata, raw array)}`, the arrays as the model holds them."""
    return {
      p: (type(v), v.get_metadata(), v.get_raw_value())
      for p, v in nnx.to_flat_state(nnx.state(model))
    }

  def same_nnx_variables(model, expected):
    got = nnx_variables(model)
    return got.keys() == expected.keys() and all(
      got[p][:2] == expected[p][:2] and got[p][2] is expected[p][2] for p in got
    )

  def report(name, value):
    print(f"{name}: {bool(value)}")

  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  x = jax.device_put(
    jax.random.normal(jax.random.key(9), (8, 16)), NamedSharding(mesh, P("data", None))
  )
  one_device = jax.devices()[0]

  # --- Linen: logical axis names and rules --------------------------------------------
  rules = (("batch", "data"), ("embed", None), ("mlp", "model"))

  class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      lecun, zeros = nn.initializers.lecun_normal(), nn.initializers.zeros_init()
      h = nn.Dense(
        32,
        kernel_init=nn.with_logical_partitioning(lecun, ("embed", "mlp")),
        bias_init=nn.with_logical_partitioning(zeros, ("mlp",)),
      )(x)
      h = nn.with_logical_constraint(nn.relu(h), ("batch", "mlp"))
      return nn.Dense(16, kernel_init=nn.with_logical_partitioning(lecun, ("mlp", "embed")))(h)

  module = LinenMLP()
  with mesh, nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(module.init, jax.random.key(0), x)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    variables = jax.jit(module.init, out_shardings=shardings)(jax.random.key(0), x)
    kernel = variables["params"]["Dense_0"]["kernel"]
    report("linen kernel sharded", kernel.value.sharding.spec == P(None, "model"))

    tree = fl.unflaxify(module, variables, x)
    report(
      "linen buffers shared",
      same_arrays(
        {v.label: v.value for v in fl.variables_in(tree)},
        {
          f"params:{a}/{b}": variables["params"][a][b]
          for a in ("Dense_0", "Dense_1")
          for b in ("kernel", "bias")
        },
      ),
    )
    native = module.apply(variables, x)
    eager = tree(fl.ArgsAndKwargs.capture(x))
    report("linen eager exact", bits_equal(eager, native))
    report("linen eager sharding", same_sharding(eager, native))
    native_jit = jax.jit(module.apply)(variables, x)
    jitted = fl.variable_jit(lambda t, x: t(fl.ArgsAndKwargs.capture(x)))(tree, x)
    report("linen jit exact", bits_equal(jitted, native_jit))
    report("linen jit sharding", same_sharding(jitted, native_jit))
    unbound, values = fl.unbind_variables(tree, freeze=True)
    stateless = jax.jit(lambda v, x: unbound.stateless_call(v, fl.ArgsAndKwargs.capture(x))[0])
    out = stateless(values, x)
    report("linen stateless jit exact", bits_equal(out, native_jit))
    report("linen stateless jit sharding", same_sharding(out, native_jit))

    captured = fl.unflaxify(module, variables, x, capture_intermediates=True)
    ours = jax.jit(
      lambda v, x: fl.unbind_variables(captured, freeze=True)[0].stateless_call(
        v, fl.ArgsAndKwargs.capture(x)
      )[1]
    )(fl.unbind_variables(captured, freeze=True)[1], x)
    _, theirs = jax.jit(lambda v, x: module.apply(v, x, capture_intermediates=True))(variables, x)
    ours = {v.label: v.value for v in ours}
    theirs_flat = {
      f"intermediates:{k}/__call__": v["__call__"]
      for k, v in theirs["intermediates"].items()
      if k != "__call__"
    }
    report(
      "linen intermediates sharding",
      all(same_sharding(ours[k], theirs_flat[k]) for k in theirs_flat) and bool(theirs_flat),
    )

    isolated = fl.isolate(tree, x, "Dense_1")
    report("linen isolate on mesh exact", isolated.replay())
    report(
      "linen isolated input sharded", not isolated.saved_arg.args[0].sharding.is_fully_replicated
    )
    exported = tree.export()
    report("linen export same arrays and boxes", same_arrays(exported, variables))
  local = jax.device_put(isolated, one_device)
  replay = local.replay()
  report("linen isolate on one device exact", replay)
  print(f"linen isolate on one device max diff: {replay.max_abs}")

  # --- NNX: sharding names, nnx.jit, a mesh context -------------------------------------
  class NNXMLP(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(
        16,
        32,
        kernel_metadata={"sharding_names": (None, "model")},
        bias_metadata={"sharding_names": ("model",)},
        rngs=rngs,
      )
      self.down = nnx.Linear(32, 16, kernel_metadata={"sharding_names": ("model", None)}, rngs=rngs)

    def __call__(self, x):
      return self.down(nnx.relu(self.up(x)))

  with jax.set_mesh(mesh):
    model = nnx.jit(lambda: NNXMLP(nnx.Rngs(0)))()
    report("nnx kernel sharded", model.up.kernel[...].sharding.spec == P(None, "model"))
    original = nnx_variables(model)  # nnx.jit below stores its outputs into `model`.
    tree = fl.unflaxify(model, x)
    held = {v.label: v.value for v in fl.variables_in(tree)}
    report(
      "nnx buffers shared",
      all(
        held[f"Param:{m}/{n}"] is getattr(getattr(model, m), n).get_raw_value()
        for m in ("up", "down")
        for n in ("kernel", "bias")
      ),
    )
    native = nnx.jit(lambda m, x: m(x))(model, x)
    jitted = fl.variable_jit(lambda t, x: t(fl.ArgsAndKwargs.capture(x)))(tree, x)
    report("nnx jit exact", bits_equal(jitted, native))
    report("nnx jit sharding", same_sharding(jitted, native))
    unbound, values = fl.unbind_variables(tree, freeze=True)
    out = jax.jit(lambda v, x: unbound.stateless_call(v, fl.ArgsAndKwargs.capture(x))[0])(values, x)
    report("nnx stateless jit exact", bits_equal(out, native))
    report("nnx stateless jit sharding", same_sharding(out, native))
    eager = tree(fl.ArgsAndKwargs.capture(x))
    native_eager = model(x)
    report("nnx eager exact", bits_equal(eager, native_eager))
    report("nnx eager sharding", same_sharding(eager, native_eager))
    isolated = fl.isolate(tree, x, "down")
    report("nnx isolate on mesh exact", isolated.replay())
    exported = tree.export()
    report("nnx export same arrays and metadata", same_nnx_variables(exported, original))
    target = nnx.jit(lambda: NNXMLP(nnx.Rngs(1)))()
    tree.export(into=target)
    report("nnx export into same arrays and metadata", same_nnx_variables(target, original))
  local = jax.device_put(isolated, one_device)
  replay = local.replay()
  report("nnx isolate on one device exact", replay)
  print(f"nnx isolate on one device max diff: {replay.max_abs}")


if __name__ == "__main__":
  main()
