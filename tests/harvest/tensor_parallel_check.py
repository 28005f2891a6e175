"""Run by test_tensor_parallel.py in a subprocess with eight CPU devices: Linen and NNX token
models whose parameters are sharded over a 2x4 mesh ('data' x 'model') harvest, the
batches placed along 'data' by `sharding=`. The hidden layer's output is sharded along its
features over 'model': each piece is written at its feature offset. The rows equal Flax's
own capture, compiled on the same mesh, bit for bit. Prints `check: True/False` lines.
"""

from __future__ import annotations

import os
import sys
import tempfile


def main() -> None:
  """Imports JAX only here, so that importing this file (doctest collection) is inert."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  import flax.linen as nn
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import flaxlens as fl
  from flaxlens.tools.harvest import _writing
  from harvest import models

  width, hidden = models.WIDTH, 4 * models.WIDTH
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  rows = NamedSharding(mesh, P("data"))
  batches = models.token_batches(3, size=4, seed=3)

  class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      lecun, zeros = nn.initializers.lecun_normal(), nn.initializers.zeros_init()
      x = nn.Embed(models.VOCAB, width)(tokens)
      h = nn.Dense(
        hidden,
        kernel_init=nn.with_partitioning(lecun, (None, "model")),
        bias_init=nn.with_partitioning(zeros, ("model",)),
        name="up",
      )(x)
      return x + nn.Dense(
        width, kernel_init=nn.with_partitioning(lecun, ("model", None)), name="down"
      )(nn.relu(h))

  class NNXNet(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(models.VOCAB, width, rngs=rngs)
      self.up = nnx.Linear(
        width,
        hidden,
        kernel_metadata={"sharding_names": (None, "model")},
        bias_metadata={"sharding_names": ("model",)},
        rngs=rngs,
      )
      self.down = nnx.Linear(
        hidden, width, kernel_metadata={"sharding_names": ("model", None)}, rngs=rngs
      )

    def __call__(self, tokens):
      x = self.embed(tokens)
      return x + self.down(nnx.relu(self.up(x)))

  def linen():
    module = LinenNet()
    abstract = jax.eval_shape(module.init, jax.random.key(0), batches[0])
    init = jax.jit(module.init, out_shardings=nn.get_sharding(abstract, mesh))
    variables = init(jax.random.key(0), batches[0])  # boxed: nn.Partitioned
    kernel = variables["params"]["up"]["kernel"].value

    @jax.jit
    def native(variables, tokens):
      _, state = module.apply(
        variables, tokens, capture_intermediates=True, mutable=["intermediates"]
      )
      return {site: state["intermediates"][site]["__call__"][0] for site in ("up", "down")}

    tree = fl.unflaxify(module, variables, batches[0])
    return tree, kernel, lambda tokens: native(variables, tokens)

  def nnx_model():
    with jax.set_mesh(mesh):
      model = nnx.jit(lambda: NNXNet(nnx.Rngs(0)))()
    kernel = model.up.kernel.get_raw_value()
    capture = nnx.capture(lambda m, t: m(t), nnx.Intermediate, method_outputs=nnx.Intermediate)

    @nnx.jit
    def native(model, tokens):
      _, state = capture(model, tokens)
      return {site: state[site]["__call__"][0] for site in ("up", "down")}

    tree = fl.unflaxify(model, batches[0])
    return tree, kernel, lambda tokens: native(nnx.clone(model), tokens)

  pieces = []  # the regions of the other axes of every piece written
  original = _writing.pieces

  def recorded(array, counts):
    found = original(array, counts)
    pieces.extend(rest for _, rest, _ in found)
    return found

  def report(name, value):
    print(f"{name}: {bool(value)}")

  for framework, build in (("linen", linen), ("nnx", nnx_model)):
    tree, kernel, native = build()
    report(f"{framework} kernel sharded", kernel.sharding.spec == P(None, "model"))
    pieces.clear()
    _writing.pieces = recorded
    try:
      stored = fl.harvest(
        tree,
        batches,
        ["up", "down"],
        tempfile.mkdtemp() + "/s",
        positions={"up": models.not_padding, "down": "all"},
        ids=models.token_ids,
        sharding=rows,
        progress=False,
      )
    finally:
      _writing.pieces = original
    offsets = {r[0].start for r in pieces if r}
    report(f"{framework} written at feature offsets", offsets == set(range(0, hidden, hidden // 4)))
    placed = [jax.device_put(b, rows) for b in batches]
    theirs = [native(tokens) for tokens in placed]
    report(
      f"{framework} hidden sharded along features",
      all(t["up"].sharding.spec[-1] == "model" for t in theirs),
    )
    up = np.concatenate(
      [np.asarray(t["up"])[models.not_padding(b)] for t, b in zip(theirs, batches, strict=True)]
    )
    down = np.concatenate([np.asarray(t["down"]).reshape(-1, width) for t in theirs])
    report(
      f"{framework} masked rows exact",
      np.array_equal(stored["up"][:].view(np.uint8), up.view(np.uint8)),
    )
    report(
      f"{framework} rows exact",
      np.array_equal(stored["down"][:].view(np.uint8), down.view(np.uint8)),
    )
    ids = np.concatenate([b[models.not_padding(b)] for b in batches])
    report(f"{framework} ids exact", np.array_equal(stored["up"].ids[:], ids))


if __name__ == "__main__":
  main()
