"""`flaxlens demo`: the whole workflow on built-in tiny models, each step saying what it proved.

Linen: convert and check, the call table, capture the residual stream, ablate and steer
(one compile for many strengths), a patching sweep drawn as a heatmap, isolate a block,
save it and replay it in a fresh process, export the edit and check equivalence, write
the browser view. NNX: convert and check, capture, steer. Files go to a new temporary
directory whose path is printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

_SHADES = " .:-=+*#%@"


def text_heatmap(values: Any, rows: list[str], width: int = 2) -> list[str]:
  """A compact terminal rendering of a 2-D array: one shade character per cell.

  Example:
    >>> from flaxlens._demo import text_heatmap
    >>> text_heatmap([[0.0, 1.0], [0.5, 0.25]], ["a", "b"], width=1)
    ['a | @|', 'b |=:|', "   ' ' = 0 ... '@' = 1"]
  """
  import numpy as np

  values = np.asarray(values, dtype=np.float64)
  low, high = float(values.min()), float(values.max())
  scale = (high - low) or 1.0
  label = max(len(r) for r in rows)
  lines = []
  for name, row in zip(rows, values, strict=True):
    cells = "".join(_SHADES[round((v - low) / scale * (len(_SHADES) - 1))] * width for v in row)
    lines.append(f"{name:<{label}} |{cells}|")
  lines.append(f"{'':<{label}}  ' ' = {low:.3g} ... '@' = {high:.3g}")
  return lines


def demo(cache: bool = True, cache_folder: str | None = None) -> int:
  """Runs the demo; returns 0 if every check held.

  With `cache`, compiled programs are kept in JAX's persistent compilation cache at
  `cache_folder` (`fl.enable_compilation_cache`: None for its default), so a second demo
  reads them instead of compiling.
  """
  print("flaxlens demo: importing JAX and Flax ...", flush=True)
  from rich.console import Console

  console = Console(highlight=False, soft_wrap=True)
  with console.status("importing jax, flax and flaxlens ..."):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import flaxlens as fl
    from flaxlens._demo_model import TinyLM, TinyMLP

    folder = fl.enable_compilation_cache(cache_folder) if cache else None
  if folder is not None:
    console.print(f"compilation cache: {folder} (--no-cache compiles afresh)")

  out_dir = tempfile.mkdtemp(prefix="flaxlens-demo-")
  proofs: list[bool] = []

  def say(text: str, proof: bool | None = None) -> None:
    if proof is not None:
      proofs.append(bool(proof))
      text = f"{text}: {bool(proof)}"
    console.print(text)

  def same(a: Any, b: Any) -> bool:
    return all(
      np.array_equal(np.asarray(x), np.asarray(y))
      for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )

  # 1. Convert and check.
  model = TinyLM()
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
  variables = model.init(jax.random.key(0), tokens)
  console.print("\n[bold]1. Linen[/]: converting a 2-block transformer (fl.unflaxify) ...")
  with console.status("converting ..."):
    tree = fl.unflaxify(model, variables, tokens)
    native = model.apply(variables, tokens)
    ours = tree(fl.ArgsAndKwargs.capture(tokens))
  print(fl.summary(tree, argument=fl.ArgsAndKwargs.capture(tokens)))
  say("\ntree(tokens) == model.apply(variables, tokens) bit for bit", same(native, ours))

  # 2. Capture the residual stream.
  console.print("\n[bold]2. Capture[/]: fl.capture(tree, tokens, at='Block_*') ...")
  with console.status("compiling the capture ..."):
    logits, captured = fl.capture(tree, tokens, at="Block_*")
  shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in captured.items())
  say(f"residual stream: {shapes}")
  compiled = jax.jit(model.apply)(variables, tokens)
  say("the capturing run's logits equal jax.jit(model.apply)'s bit for bit", same(logits, compiled))

  # 3. Ablate and steer.
  console.print("\n[bold]3. Ablate and steer[/]: interventions compiled into the run ...")
  with console.status("ablating and steering ..."):
    ablated = fl.run(
      tree, tokens, interventions=[fl.ablate("Block_1/MultiHeadDotProductAttention_0")]
    )
    vector = captured["Block_0"][0, 0] - captured["Block_0"][1, 0]
    steerings = [fl.steer("Block_0", vector, float(a)) for a in range(20)]
    with fl.count_compiles() as compiles:
      steered = [fl.run(tree, tokens, interventions=[s]) for s in steerings]
    moved = [float(jnp.abs(out - native).max()) for out in steered]
  say(
    "zero-ablating Block_1's attention moves the logits by up to"
    f" {float(jnp.abs(ablated - native).max()):.4f}"
  )
  say(f"steering Block_0 with strengths 0..19 moves them by up to {moved[-1]:.4f}")
  say("20 steering strengths, one compilation", compiles.traces == compiles.requests == 1)
  say(
    f"  (fl.count_compiles: traces {compiles.traces}, XLA compilations"
    f" {compiles.compilations}, read from the compilation cache {compiles.cache_hits})"
  )

  # 4. Patching sweep.
  console.print("\n[bold]4. Patching sweep[/]: every block x position in one compiled call ...")
  corrupted = tokens.at[:, 2].set((tokens[:, 2] + 1) % 32)
  answer = int(native[0, -1].argmax())

  def metric(output):
    return output[0, -1, answer]

  with console.status("sweeping ..."):
    swept = fl.sweep(tree, tokens, corrupted, "Block_*", metric, positions=range(8))
    picture = os.path.join(out_dir, "sweep.png")
    drew = _plot(swept, picture)
  for line in text_heatmap(swept.values, list(swept.sites)):
    console.print(f"  {line}")
  if drew:
    say(f"heatmap: {picture}")
  one = fl.run(
    tree,
    corrupted,
    interventions=[fl.patch("Block_0", captured["Block_0"], where=jnp.s_[:, 2])],
  )
  say(
    "the sweep's (Block_0, position 2) cell equals that single patch",
    bool(np.allclose(swept.values[0, 2], metric(one), atol=1e-5)),
  )

  # 5. Isolate, save, replay in a fresh process.
  console.print("\n[bold]5. Isolate[/]: Block_1 with its inputs, saved and replayed elsewhere ...")
  with console.status("isolating, saving and replaying in a new process ..."):
    isolated = fl.isolate(tree, tokens, "Block_1")
    path = os.path.join(out_dir, "block_1")
    fl.save_isolated(isolated, path)
    replayed = subprocess.run(
      [sys.executable, "-m", "flaxlens.cli", "replay", path, *_cache_option(folder)],
      capture_output=True,
      text=True,
      timeout=120,
    )
  say("saved, then `flaxlens replay` in a fresh process: exact", replayed.returncode == 0)
  say(f"artifact: {path}")

  # 6. Export the edit, check equivalence.
  console.print("\n[bold]6. Export[/]: edit a parameter, export to Flax, check equivalence ...")
  head = tree.select().at_path("head").get()
  head.scope_data.parameters["bias"].value = head.scope_data.parameters["bias"].value + 1.0
  with console.status("checking ..."):
    report = fl.check_equivalence(tree, (model, tree.export()), tokens)
  say("the edited tree and model.apply(tree.export(), ...) agree bit for bit", bool(report))
  shifted = tree(fl.ArgsAndKwargs.capture(tokens))
  say("adding 1 to the head's bias shifts every logit by 1", np.allclose(shifted - native, 1.0))

  # 7. The browser view.
  page = os.path.join(out_dir, "tree.html")
  with console.status("rendering the browser view ..."):
    fl.to_html(tree, page, argument=fl.ArgsAndKwargs.capture(tokens))
  say(f"\n[bold]7. Browser view[/] (opens from the file, no server): {page}")

  # 8. NNX.
  console.print("\n[bold]8. NNX[/]: an MLP with a batch norm, in training mode ...")
  mlp = TinyMLP(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(2), (4, 32))
  with console.status("converting ..."):
    nnx_tree = fl.unflaxify(mlp, x)
    nnx_ours, nnx_cache = fl.capture(nnx_tree, x, at="norm", jit=False)
  say("tree(x) == model(x) bit for bit", same(mlp(x), nnx_ours))
  stats = nnx_tree.select().at_path("norm").get().scope_data.variables["batch_stats"]["mean"]
  say(
    "the tree's batch statistics follow the model's after the call",
    same(stats.value, mlp.norm.mean[...]),
  )
  steered = fl.run(nnx_tree, x, interventions=[fl.steer("norm", jnp.ones(128), 0.5)], jit=False)
  say(
    f"captured norm {tuple(nnx_cache['norm'].shape)}; steering it moves the output by up to"
    f" {float(jnp.abs(steered - nnx_ours).max()):.4f}"
  )
  ok = all(proofs)
  console.print(f"\n{'every check held' if ok else 'a check FAILED'}; files: {out_dir}")
  return 0 if ok else 1


def _cache_option(folder: str | None) -> list[str]:
  """The `flaxlens` option that makes a command use the demo's compilation cache."""
  return ["--no-cache"] if folder is None else ["--compilation-cache", folder]


def _plot(result: Any, path: str) -> bool:
  """Writes the sweep's heatmap if matplotlib is installed (`flaxlens[plots]`)."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return False
  result.plot(path, title="logit of the clean answer, patched from the clean run")
  return True
