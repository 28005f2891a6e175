"""The `flaxlens` command line.

`flaxlens demo` converts an embedded model, checks it against Flax, patches and edits
it; `flaxlens replay PATH [--allow PKG]` re-runs a saved isolated call and compares it with
what was saved (exit status 0 on an exact match, 1 if it differs, 2 if the artifact is
refused).
"""

from __future__ import annotations

import argparse
import sys


def demo() -> int:
  """Converts a small Linen transformer, checks it against Flax, patches and edits it."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from rich.console import Console

  import flaxlens as fl
  from flaxlens._demo_model import TinyLM

  console = Console()
  model = TinyLM()
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
  variables = model.init(jax.random.key(0), tokens)
  tree = fl.unflaxify(model, variables, tokens)
  console.print("[bold]flaxlens demo[/]: a 2-block Linen transformer, converted\n")
  print(fl.summary(tree))

  native = model.apply(variables, tokens)
  ours = tree(fl.ArgsAndKwargs.capture(tokens))
  exact = bool(np.array_equal(np.asarray(native), np.asarray(ours)))
  console.print(f"\ntree(tokens) == model.apply(variables, tokens) bit for bit: {exact}")

  class Zero(fl.Layer):
    def __call__(self, argument, /, **side_inputs):
      return jnp.zeros_like(argument.args[0])

  patched = tree.select().at_path("Block_1/MultiHeadDotProductAttention_0").apply(lambda _: Zero())
  change = float(jnp.abs(patched(fl.ArgsAndKwargs.capture(tokens)) - ours).max())
  console.print(f"zeroing Block_1's attention changes the logits by up to {change:.4f}")

  head = tree.select().at_path("head").get()
  head.scope_data.parameters["bias"].value = head.scope_data.parameters["bias"].value + 1.0
  shifted = tree(fl.ArgsAndKwargs.capture(tokens))
  console.print(
    "adding 1 to the head's bias shifts every logit by 1:"
    f" {bool(np.allclose(np.asarray(shifted - ours), 1.0, atol=1e-5))}"
  )
  return 0 if exact else 1


def replay(path: str, jit: bool | None, allow: list[str]) -> int:
  """Loads an isolated-call artifact, replays it and prints the per-leaf comparison.

  Exit status: 0 exact replay, 1 replay differs, 2 the artifact was refused or its call
  could not be replayed.
  """
  from rich.console import Console

  import flaxlens as fl

  console = Console()
  try:
    isolated = fl.load_isolated(path, allow=allow)
  except fl.ArtifactError as e:
    print(f"flaxlens replay: {e}", file=sys.stderr)
    return 2
  try:
    report = isolated.replay(jit=jit)
  except Exception as e:
    print(f"flaxlens replay: the saved call raised {type(e).__name__}: {e}", file=sys.stderr)
    return 2
  for leaf, same in report.identical.items():
    verdict = "[green]match[/]" if same else f"[red]{report.verdict(leaf)}[/]"
    console.print(f"{leaf}  {verdict}", highlight=False)
  console.print("[bold green]exact replay[/]" if report.exact else "[bold red]replay differs[/]")
  if report.note and not report.exact:
    console.print(f"note: {report.note}", highlight=False)
  return 0 if report.exact else 1


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="flaxlens", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  commands = parser.add_subparsers(dest="command", required=True)
  commands.add_parser("demo", help="convert an embedded model, check it, patch and edit it")
  replay_parser = commands.add_parser("replay", help="re-run a saved isolated call")
  replay_parser.add_argument("path", help="artifact directory written by fl.save_isolated")
  mode = replay_parser.add_mutually_exclusive_group()
  mode.add_argument(
    "--jit", dest="jit", action="store_const", const=True, help="force a replay under jax.jit"
  )
  mode.add_argument(
    "--eager", dest="jit", action="store_const", const=False, help="force an eager replay"
  )
  replay_parser.add_argument(
    "--allow",
    action="append",
    default=[],
    metavar="PKG",
    help="let the artifact import classes and functions from package PKG (repeatable);"
    " only for artifacts from a source you trust",
  )
  args = parser.parse_args(argv)
  if args.command == "demo":
    return demo()
  if args.command == "replay":
    return replay(args.path, args.jit, args.allow)
  return 2


if __name__ == "__main__":
  sys.exit(main())
