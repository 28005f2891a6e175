"""`flaxlens demo`: the whole workflow on built-in tiny models, each step saying what it proved.

Linen: convert and check, the call table, capture the residual stream, ablate and steer
(one compile for many strengths), a patching sweep drawn as a heatmap, isolate a block,
save it and replay it in a fresh process, export the edit and check equivalence, write
the browser view. NNX: convert and check, capture, steer. Then the research half on the
Linen model: a heads sweep over 16 prompts with bootstrap intervals, one path patch, and a
small harvest of the residual stream. Files go to a new temporary directory whose path is
printed; steps whose optional extra is missing (matplotlib, TensorStore) say how to get it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

_SHADES = " .:-=+*#%@"
_ATTENTION = "MultiHeadDotProductAttention_0"


def text_heatmap(
  values: Any, rows: list[str], quantity: str = "metric", width: int = 2
) -> list[str]:
  """A compact terminal rendering of a 2-D array: one shade character per cell.

  The last line is the legend: what the cells measure (`quantity`) and the values of
  the lightest and the darkest shade.

  Example:
    >>> from flaxlens._demo import text_heatmap
    >>> text_heatmap([[0.0, 1.0], [0.5, 0.25]], ["a", "b"], width=1)
    ['a | @|', 'b |=:|', "   metric: ' ' = 0 ... '@' = 1"]
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
  lines.append(f"{'':<{label}}  {quantity}: ' ' = {low:.3g} ... '@' = {high:.3g}")
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
    import flaxlens as fl

    folder = fl.enable_compilation_cache(cache_folder) if cache else None
  story = _Story(console, tempfile.mkdtemp(prefix="flaxlens-demo-"), folder)
  if folder is not None:
    story.say(f"compilation cache: {_shown(folder)} (--no-cache compiles afresh)")
  story.linen()
  story.nnx()
  story.research()
  ok = all(story.proofs)
  story.say(f"\n{'every check held' if ok else 'a check FAILED'}; files: {_shown(story.out_dir)}")
  return 0 if ok else 1


class _Story:
  """The demo's steps, in the order they are told, and what they have proved so far."""

  def __init__(self, console: Any, out_dir: str, cache_folder: str | None):
    import jax
    from flax import nnx

    from flaxlens._demo_model import TinyLM, TinyMLP

    self.console, self.out_dir, self.cache_folder = console, out_dir, cache_folder
    self.proofs: list[bool] = []
    self.model = TinyLM()
    self.tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
    self.variables = self.model.init(jax.random.key(0), self.tokens)
    self.mlp = TinyMLP(nnx.Rngs(0))

  def say(self, text: str, proof: bool | None = None) -> None:
    from rich.markup import escape

    if proof is not None:
      self.proofs.append(bool(proof))
      text = f"{text}: {bool(proof)}"
    self.console.print(escape(text))  # plain text: `flaxlens[plots]` is no markup

  def step(self, title: str, what: str) -> None:
    from rich.markup import escape

    self.console.print(f"\n[bold]{escape(title)}[/]: {escape(what)}")

  def linen(self) -> None:
    """Steps 1-7: convert, capture, intervene, sweep, isolate, export, view."""
    import flaxlens as fl

    self.step("1. Linen", "converting a 2-block transformer (fl.unflaxify) ...")
    with self.console.status("converting ..."):
      self.tree = fl.unflaxify(self.model, self.variables, self.tokens)
      self.native = self.model.apply(self.variables, self.tokens)
      ours = self.tree(fl.ArgsAndKwargs.capture(self.tokens))
    print(fl.summary(self.tree, argument=fl.ArgsAndKwargs.capture(self.tokens)))
    self.say(
      "\ntree(tokens) == model.apply(variables, tokens) bit for bit", _same(self.native, ours)
    )
    self._capture()
    self._intervene()
    self._sweep()
    self._isolate()
    self._export()
    page = os.path.join(self.out_dir, "tree.html")
    with self.console.status("rendering the browser view ..."):
      fl.to_html(self.tree, page, argument=fl.ArgsAndKwargs.capture(self.tokens))
    self.step("7. Browser view", f"{_shown(page)} (opens from the file, no server)")

  def _capture(self) -> None:
    import jax

    import flaxlens as fl

    self.step("2. Capture", "fl.capture(tree, tokens, at='Block_*') ...")
    with self.console.status("compiling the capture ..."):
      logits, self.captured = fl.capture(self.tree, self.tokens, at="Block_*")
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in self.captured.items())
    self.say(f"residual stream: {shapes}")
    compiled = jax.jit(self.model.apply)(self.variables, self.tokens)
    self.say(
      "the capturing run's logits equal jax.jit(model.apply)'s bit for bit", _same(logits, compiled)
    )

  def _intervene(self) -> None:
    import jax.numpy as jnp

    import flaxlens as fl

    self.step("3. Ablate and steer", "interventions compiled into the run ...")
    with self.console.status("ablating and steering ..."):
      ablated = fl.run(self.tree, self.tokens, interventions=[fl.ablate(f"Block_1/{_ATTENTION}")])
      vector = self.captured["Block_0"][0, 0] - self.captured["Block_0"][1, 0]
      steerings = [fl.steer("Block_0", vector, float(a)) for a in range(20)]
      with fl.count_compiles() as compiles:
        steered = [fl.run(self.tree, self.tokens, interventions=[s]) for s in steerings]
      moved = [float(jnp.abs(out - self.native).max()) for out in steered]
    self.say(
      "zero-ablating Block_1's attention moves the logits by up to"
      f" {float(jnp.abs(ablated - self.native).max()):.4f}"
    )
    self.say(f"steering Block_0 with strengths 0..19 moves them by up to {moved[-1]:.4f}")
    self.say("20 steering strengths, one compilation", compiles.traces == compiles.requests == 1)
    self.say(
      f"  (fl.count_compiles: traces {compiles.traces}, XLA compilations"
      f" {compiles.compilations}, read from the compilation cache {compiles.cache_hits})"
    )

  def _sweep(self) -> None:
    import jax.numpy as jnp
    import numpy as np

    import flaxlens as fl

    self.step("4. Patching sweep", "every block x position in one compiled call ...")
    tokens = self.tokens
    corrupted = tokens.at[:, 2].set((tokens[:, 2] + 1) % 32)
    answer = int(self.native[0, -1].argmax())

    def metric(output):
      return output[0, -1, answer]

    with self.console.status("sweeping ..."):
      swept = fl.sweep(self.tree, tokens, corrupted, "Block_*", metric, positions=range(8))
      drawn = _plot(swept, os.path.join(self.out_dir, "sweep.png"))
    quantity = "logit of the clean answer after patching"
    for line in text_heatmap(swept.values, list(swept.sites), quantity):
      self.say(f"  {line}")
    self.say(drawn)
    one = fl.run(
      self.tree,
      corrupted,
      interventions=[fl.patch("Block_0", self.captured["Block_0"], where=jnp.s_[:, 2])],
    )
    self.say(
      "the sweep's (Block_0, position 2) cell equals that single patch",
      bool(np.allclose(swept.values[0, 2], metric(one), atol=1e-5)),
    )

  def _isolate(self) -> None:
    import flaxlens as fl

    self.step("5. Isolate", "Block_1 with its inputs, saved and replayed elsewhere ...")
    with self.console.status("isolating, saving and replaying in a new process ..."):
      isolated = fl.isolate(self.tree, self.tokens, "Block_1")
      path = os.path.join(self.out_dir, "block_1")
      fl.save_isolated(isolated, path)
      replayed = subprocess.run(
        [sys.executable, "-m", "flaxlens.cli", "replay", path, *_cache_option(self.cache_folder)],
        capture_output=True,
        text=True,
        timeout=120,
      )
    self.say("saved, then `flaxlens replay` in a fresh process: exact", replayed.returncode == 0)
    self.say(f"artifact: {_shown(path)}")

  def _export(self) -> None:
    import numpy as np

    import flaxlens as fl

    self.step("6. Export", "edit a parameter, export to Flax, check equivalence ...")
    bias = self.tree.select().at_path("head").get().scope_data.parameters["bias"]
    original = bias.value
    bias.value = original + 1.0
    try:
      with self.console.status("checking ..."):
        report = fl.check_equivalence(self.tree, (self.model, self.tree.export()), self.tokens)
      shifted = self.tree(fl.ArgsAndKwargs.capture(self.tokens))
    finally:
      bias.value = original  # the later steps study the model as it was
    self.say("the edited tree and model.apply(tree.export(), ...) agree bit for bit", bool(report))
    self.say(
      "adding 1 to the head's bias shifts every logit by 1", np.allclose(shifted - self.native, 1.0)
    )

  def nnx(self) -> None:
    """Step 8: an NNX model converted, checked, captured and steered."""
    import jax
    import jax.numpy as jnp

    import flaxlens as fl

    self.step("8. NNX", "an MLP with a batch norm, in training mode ...")
    x = jax.random.normal(jax.random.key(2), (4, 32))
    with self.console.status("converting ..."):
      tree = fl.unflaxify(self.mlp, x)
      ours, cache = fl.capture(tree, x, at="norm", jit=False)
    self.say("tree(x) == model(x) bit for bit", _same(self.mlp(x), ours))
    stats = tree.select().at_path("norm").get().scope_data.variables["batch_stats"]["mean"]
    self.say(
      "the tree's batch statistics follow the model's after the call",
      _same(stats.value, self.mlp.norm.mean[...]),
    )
    steered = fl.run(tree, x, interventions=[fl.steer("norm", jnp.ones(128), 0.5)], jit=False)
    self.say(
      f"captured norm {tuple(cache['norm'].shape)}; steering it moves the output by up to"
      f" {float(jnp.abs(steered - ours).max()):.4f}"
    )

  def research(self) -> None:
    """Steps 9-11 on 16 prompts: a heads sweep with intervals, a path patch, a harvest."""
    import jax
    import jax.numpy as jnp

    self.prompts = jax.random.randint(jax.random.key(3), (16, 8), 0, 32)
    self.corrupted = self.prompts.at[:, 2].set((self.prompts[:, 2] + 1) % 32)
    answers = self.model.apply(self.variables, self.prompts)[:, -1].argmax(-1)

    def answer_logit(output):  # one value per prompt: its clean answer's logit
      return jnp.take_along_axis(output[:, -1], answers[:, None], axis=-1)[:, 0]

    self.answer_logit = answer_logit
    self._heads_sweep()
    self._path_patch()
    self._harvest()

  def _heads_sweep(self) -> None:
    import numpy as np

    import flaxlens as fl

    self.step("9. Heads sweep", "each attention head patched in turn, over 16 prompts ...")
    heads = fl.heads(f"Block_*/{_ATTENTION}")
    with self.console.status("sweeping the heads ..."):
      swept = fl.sweep(
        self.tree, self.prompts, self.corrupted, heads, self.answer_logit, per_example=True
      )
      effect = swept.normalised()
      low, high = swept.bootstrap(n=1000, normalised=True)
    grid = np.asarray(effect).reshape(2, -1)
    legend = "share of the clean-corrupted gap each head restores"
    columns = "".join(f"h{h:<2}" for h in range(grid.shape[1])).rstrip()
    self.say(f"  {'':<7}  {columns}")  # over the cells, three characters a head
    for line in text_heatmap(grid, ["Block_0", "Block_1"], legend, width=3):
      self.say(f"  {line}")
    sure = [i for i in range(len(swept.sites)) if low[i] > 0]
    self.say(
      "heads whose 95% bootstrap interval excludes 0: "
      + (
        ", ".join(f"{_short(swept.sites[i])} [{low[i]:.2f}, {high[i]:.2f}]" for i in sure) or "none"
      )
    )
    top = int(np.argmax(effect))
    block, head = divmod(top, grid.shape[1])
    site = fl.heads(f"Block_{block}/{_ATTENTION}", head)
    _, clean = fl.capture(self.tree, self.prompts, at=site)
    (value,) = clean.values()
    one = fl.run(self.tree, self.corrupted, interventions=[fl.patch(site, value)])
    self.say(
      f"the sweep's {_short(swept.sites[top])} cell equals patching that head alone",
      bool(np.allclose(swept.values[top], np.mean(self.answer_logit(one)), atol=1e-5)),
    )

  def _path_patch(self) -> None:
    import numpy as np

    import flaxlens as fl

    sender, receiver = fl.heads(f"Block_0/{_ATTENTION}"), f"Block_1/{_ATTENTION}"
    self.step("10. Path patch", "Block_0's heads, through Block_1's attention alone ...")
    with self.console.status("path patching ..."):
      paths = fl.path_patch(
        self.tree,
        self.prompts,
        self.corrupted,
        sender,
        receiver,
        self.answer_logit,
        per_example=True,
      )
      effect = paths.normalised()
      low, high = paths.bootstrap(n=1000, normalised=True)
    self.say("share of the gap each head carries through Block_1's attention, 95% interval:")
    for i, site in enumerate(paths.sites):
      self.say(f"  {_short(site)}: {effect[i]:.2f} [{low[i]:.2f}, {high[i]:.2f}]")
    # By hand for head 0: corrupt it in a clean run and record the receiver; then give a
    # clean run that receiver value.
    head = fl.heads(f"Block_0/{_ATTENTION}", 0)
    (corrupted,) = fl.capture(self.tree, self.corrupted, at=head)[1].values()
    _, through = fl.capture(
      self.tree, self.prompts, at=receiver, interventions=[fl.patch(head, corrupted)]
    )
    out = fl.run(self.tree, self.prompts, interventions=[fl.patch(receiver, through[receiver])])
    self.say(
      "head 0's row equals the two patched runs written by hand with fl.patch",
      bool(np.allclose(paths.values[0], np.mean(self.answer_logit(out)), atol=1e-5)),
    )

  def _harvest(self) -> None:
    import jax

    import flaxlens as fl

    self.step("11. Harvest", "Block_1's residual stream over 4 batches, into a zarr store ...")
    batches = [self.prompts[i : i + 4] for i in range(0, 16, 4)]
    path = os.path.join(self.out_dir, "residual")
    try:
      with self.console.status("harvesting ..."):
        store = fl.harvest(self.tree, batches, "Block_1", path)
    except fl.FlaxlensError as error:
      if "flaxlens[harvest]" not in str(error):
        raise
      self.say('harvest not run: TensorStore is missing; pip install "flaxlens[harvest]"')
      return
    rows = store["Block_1"]
    self.say(f"{rows.shape[0]} rows of {rows.shape[1]} features, one per prompt and position")

    def native(variables, tokens):
      _, state = self.model.apply(
        variables, tokens, capture_intermediates=True, mutable=["intermediates"]
      )
      return state["intermediates"]["Block_1"]["__call__"][0]

    third = jax.jit(native)(self.variables, batches[2]).reshape(-1, rows.shape[1])
    self.say(
      "the third batch's rows equal Flax's own capture_intermediates bit for bit",
      _same(rows[2 * third.shape[0] : 3 * third.shape[0]], third),
    )
    example, position = rows.index[70]
    self.say(f"row 70 came from prompt {example}, position {position}; store: {_shown(path)}")


def _short(site: str) -> str:
  """`Block_1/MultiHeadDotProductAttention_0 head 2` as `Block_1 head 2`."""
  return site.replace(f"/{_ATTENTION}", "")


def _same(a: Any, b: Any) -> bool:
  import jax
  import numpy as np

  return all(
    np.array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
  )


def _cache_option(folder: str | None) -> list[str]:
  """The `flaxlens` option that makes a command use the demo's compilation cache."""
  return ["--no-cache"] if folder is None else ["--compilation-cache", folder]


def _shown(path: str) -> str:
  """`path` as the demo prints it: the home folder written `~`, so lines stay short."""
  home = os.path.expanduser("~")
  inside = home not in ("~", os.sep) and (path + os.sep).startswith(home + os.sep)
  return "~" + path[len(home) :] if inside else path


def _plot(result: Any, path: str) -> str:
  """Writes the sweep's heatmap to `path` if matplotlib is installed (`flaxlens[plots]`);
  returns the line that says where it is, or that it was not drawn and how to get it."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return 'heatmap picture not drawn: matplotlib is missing; pip install "flaxlens[plots]"'
  result.plot(path, title="logit of the clean answer, patched from the clean run")
  return f"heatmap: {_shown(path)}"
