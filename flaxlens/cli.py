"""The `flaxlens` command line.

`flaxlens demo` converts an embedded model, checks it against Flax, patches and edits
it; `flaxlens replay PATH [--allow PKG]` re-runs a saved isolated call and compares it with
what was saved (exit status 0 on an exact match, 1 if it differs, 2 if the artifact is
refused); `flaxlens check A B` runs two models on A's example inputs and compares their
outputs and states leaf by leaf (exit status 0 when bitwise equal, 1 if they differ, 2 if
a model could not be loaded).
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


def check(first: str, second: str) -> int:
  """Compares two models on the first one's example inputs; prints the report.

  `first` is a TARGET, `path/to/file.py:factory` or `package.module:factory`: the
  factory takes no arguments and returns `(nnx_model, inputs)` or `(linen_module,
  variables, inputs)`, `inputs` being the tuple of positional arguments of the call.
  `second` is another TARGET (its inputs are not used), or a model saved by
  `fl.save_exported` (an Orbax directory or a safetensors file), restored into the
  first model's structure.

  Exit status: 0 bitwise equal, 1 they differ, 2 a model could not be loaded or run.
  """
  import os

  import flaxlens as fl

  try:
    model, inputs = _load_target(first)
    if os.path.exists(second):
      like = model[1] if isinstance(model, tuple) else model
      restored = fl.load_exported(second, like=like)
      other = (model[0], restored) if isinstance(model, tuple) else restored
    else:
      other, _ = _load_target(second)
    report = fl.check_equivalence(model, other, *inputs)
  except Exception as e:
    print(f"flaxlens check: {type(e).__name__}: {e}", file=sys.stderr)
    return 2
  print(report)
  return 0 if report else 1


def _load_target(target: str) -> tuple[object, tuple]:
  """`(model, inputs)` from a TARGET; a Linen model is the pair `(module, variables)`."""
  import importlib
  import importlib.util
  import os

  source, sep, name = target.rpartition(":")
  if not sep or not source or not name:
    raise ValueError(
      f"{target!r} is not a TARGET; write path/to/file.py:factory or package.module:factory."
    )
  if source.endswith(".py") or os.path.sep in source:
    spec = importlib.util.spec_from_file_location(
      os.path.splitext(os.path.basename(source))[0], source
    )
    if spec is None or spec.loader is None or not os.path.isfile(source):
      raise ValueError(f"{source}: no such Python file.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  else:
    module = importlib.import_module(source)
  factory = getattr(module, name, None)
  if not callable(factory):
    raise ValueError(f"{target}: {source} has no function {name!r}.")
  made = factory()
  if not isinstance(made, tuple) or len(made) not in (2, 3):
    raise ValueError(
      f"{target}: the factory must return (nnx_model, inputs) or (linen_module,"
      f" variables, inputs), got {type(made).__name__}."
    )
  *model, inputs = made
  inputs = inputs if isinstance(inputs, tuple) else (inputs,)
  return (tuple(model) if len(model) == 2 else model[0]), inputs


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
  check_parser = commands.add_parser(
    "check",
    help="compare two models (or a model and a saved export) on example inputs",
    description=check.__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  check_parser.add_argument("first", metavar="TARGET", help="file.py:factory or pkg.mod:factory")
  check_parser.add_argument(
    "second", metavar="OTHER", help="another TARGET, or a path written by fl.save_exported"
  )
  args = parser.parse_args(argv)
  if args.command == "demo":
    return demo()
  if args.command == "replay":
    return replay(args.path, args.jit, args.allow)
  if args.command == "check":
    return check(args.first, args.second)
  return 2


if __name__ == "__main__":
  sys.exit(main())
