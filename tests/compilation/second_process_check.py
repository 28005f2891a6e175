"""One process of test_persistent_cache.py: asks every compiled tool one question each.

`python second_process_check.py CACHE OUT`: turns JAX's persistent cache on at CACHE
(`fl.enable_compilation_cache`), converts a Linen language model and an NNX MLP, then
counts (`fl.count_compiles`) what `fl.run`, `fl.capture`, `fl.sweep`, `fl.attribute`,
`fl.grad_at` and `fl.path_patch` trace and compile; writes `OUT/report.json` (the
counts per tool) and `OUT/values.npz` (each tool's result, and the native models'
outputs to compare with).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flaxlens as fl
from flaxlens._demo_model import TinyLM, TinyMLP


def questions() -> dict:
  """Each tool's question, as a function of nothing, and the native outputs."""
  model = TinyLM()
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
  corrupted = tokens.at[:, 2].set((tokens[:, 2] + 1) % 32)
  variables = model.init(jax.random.key(0), tokens)
  tree = fl.unflaxify(model, variables, tokens)
  mlp = TinyMLP(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (4, 32))
  nnx_tree = fl.unflaxify(mlp, x)
  vector = jnp.ones(32)

  def metric(out):
    return out[0, -1, 3] - out[0, -1, 5]

  return {
    "run": lambda: fl.run(tree, tokens, interventions=[fl.steer("Block_0", vector, 0.5)]),
    "capture": lambda: fl.capture(tree, tokens, at="Block_*")[1],
    "sweep": lambda: (
      fl.sweep(tree, tokens, corrupted, "Block_*", metric, positions=range(8)).values
    ),
    "attribute": lambda: fl.attribute(tree, tokens, corrupted, "Block_*", metric).values,
    "grad_at": lambda: fl.grad_at(tree, tokens, "Block_1", metric)[1],
    "path_patch": lambda: fl.path_patch(tree, tokens, corrupted, "Block_0", "head", metric).values,
    "linen_run": lambda: fl.run(tree, tokens),
    "nnx_run": lambda: fl.run(nnx_tree, x),
    "native_linen": lambda: jax.jit(model.apply)(variables, tokens),
    "native_nnx": lambda: nnx.jit(lambda m, x: m(x))(nnx.clone(mlp), x),
  }


def main(cache: str, out: str) -> None:
  fl.enable_compilation_cache(cache)
  asked = questions()
  report, values = {}, {}
  for name, ask in asked.items():
    with fl.count_compiles() as count:
      result = jax.block_until_ready(ask())
    report[name] = {
      "traces": count.traces,
      "compilations": count.compilations,
      "hits": count.cache_hits,
    }
    for i, leaf in enumerate(jax.tree_util.tree_leaves(result)):
      values[f"{name}/{i}"] = np.asarray(leaf)
  np.savez(os.path.join(out, "values.npz"), **values)
  with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
