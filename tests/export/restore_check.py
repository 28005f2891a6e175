"""Run in a fresh process by test_saving.py: restore a saved exported model, call it, compare.

Usage: `restore_check.py FRAMEWORK CASE SAVED EXPECTED.npz`. The model is built from
its class in the corpus (abstractly: `jax.eval_shape` / `nnx.eval_shape`), the saved
arrays are restored into it with `fl.load_exported`, and its native call on the corpus
inputs is compared bit for bit with the output the saving process computed from the
tree. Prints `match: True|False` and, for NNX, `metadata: True|False` (the restored
variables carry the class's metadata).
"""

from __future__ import annotations

import sys


def main() -> None:
  """Imports JAX only here, so that importing this file (doctest collection) is inert."""
  import pathlib

  import jax
  import numpy as np
  from flax import nnx

  sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
  from linen import corpus as linen_corpus
  from nnx import corpus as nnx_corpus

  import flaxlens as fl

  framework, case, saved, expected = sys.argv[1:5]
  if framework == "linen":
    module, args = {
      "logically_partitioned_scan": (linen_corpus.LogicallyPartitionedScan(), (linen_corpus.X,)),
      "transformer": (linen_corpus.Transformer(), (linen_corpus.TOKENS,)),
    }[case]
    like = jax.eval_shape(module.init, jax.random.key(0), *args)
    output = module.apply(fl.load_exported(saved, like=like), *args)
  else:
    build, args = {
      "convnet_train": (lambda: nnx_corpus.ConvNet(nnx_corpus.RNGS()), (nnx_corpus.IMG,)),
      "variable_metadata": (lambda: nnx_corpus.Annotated(nnx_corpus.RNGS()), (nnx_corpus.X,)),
    }[case]
    like = nnx.eval_shape(build)
    model = fl.load_exported(saved, like=like)
    output = model(*args)
    metadata = [(v.get_metadata(), type(v)) for _, v in nnx.to_flat_state(nnx.state(model))] == [
      (v.get_metadata(), type(v)) for _, v in nnx.to_flat_state(nnx.state(build()))
    ]
    print(f"metadata: {metadata}")
  want = np.load(expected)["output"]
  got = np.asarray(output)
  same = got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
  print(f"match: {same}")


if __name__ == "__main__":
  main()
