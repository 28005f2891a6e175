"""The `flaxlens` command line.

`flaxlens demo` converts embedded Linen and NNX models, checks them against Flax, patches
and edits them; `flaxlens inspect TARGET` prints the call table of any model a factory
function returns (`--json`, `--html`; exit status 2 if the TARGET is wrong);
`flaxlens replay PATH [--allow PKG]` re-runs a saved isolated call and compares it with
what was saved (exit status 0 on an exact match, 1 if it differs, 2 if the artifact is
refused); `flaxlens check A B` runs two models on A's example inputs and compares their
outputs and states leaf by leaf (exit status 0 when bitwise equal, 1 if they differ, 2 if
a model could not be loaded or run); `flaxlens features STORE DICTIONARY --site S
--features 1,2,3 --out page.html` writes the page of chosen features of a dictionary over a
harvest (exit status 2 if an input is refused). Whatever a TARGET's or an artifact's code raises
(`sys.exit()` included; `KeyboardInterrupt` aside) is a failure with exit status 2 and a
message naming it, never a success.

TARGETs (`inspect`, `check`) are `path/to/file.py:factory` or `package.module:factory`;
the factory takes no arguments and returns `(nnx_model, args[, kwargs])` or
`(linen_module, variables, args[, kwargs])`, example inputs included. Modules named by a
TARGET or an artifact are imported from the `--import-path DIR` folders, then the current
folder, then the installed packages.

Every command keeps the programs it compiles in JAX's persistent compilation cache, so
the next command asking the same question reads them instead of compiling: in
`$FLAXLENS_COMPILATION_CACHE` if set (`0` or `off`: no cache), else
`$XDG_CACHE_HOME/flaxlens/jax` or `~/.cache/flaxlens/jax`; `--compilation-cache DIR`
moves it, `--no-cache` turns it off for one command.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def demo(cache: bool = True, cache_folder: str | None = None) -> int:
  """Tells the whole story on built-in tiny models; see `flaxlens._demo`."""
  from flaxlens._demo import demo as run_demo

  return run_demo(cache, cache_folder)


def inspect(
  target: str,
  depth: int | None,
  path: str | None,
  as_json: bool,
  html_path: str | None,
  debug: bool,
  import_path: list[str] | None = None,
) -> int:
  """Prints the call table of the model TARGET names (or its JSON); writes the web page.

  The page goes to `html_path`, whose missing parent folders are made (as
  `fl.save_exported` makes them).

  Exit status: 0 on success, 2 if the TARGET cannot be loaded or converted (anything its
  code raises, a `sys.exit()` included), the path pattern matches no call, or the page
  cannot be written (the message says what to change; `debug` re-raises instead).
  """
  import json
  import os
  import shutil
  import textwrap

  import flaxlens as fl
  from flaxlens._target import load, said, sentence

  if html_path is not None and os.path.isdir(html_path):
    print(
      f"flaxlens inspect: --html {html_path!r} is a directory. Give the path of the file"
      f" to write the page to, such as {os.path.join(html_path, 'tree.html')!r}.",
      file=sys.stderr,
    )
    return 2
  try:
    loaded = load(target, import_path)
    options = dict(argument=loaded.argument, **loaded.side_inputs)
    table = fl.summary(loaded.tree, depth, path=path, **options)
    if path is not None and not table.rows:
      raise _nothing_shown(loaded.tree, path, depth)
    page = None if html_path is None else fl.to_html(loaded.tree, max_depth=depth, **options)
  except fl.FlaxlensError as e:
    if debug:
      raise
    print(f"flaxlens inspect: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # The model's code, run again for the root call's row.
    if debug:
      raise
    print(
      f"flaxlens inspect: {target}: running the converted model raised {sentence(said(e))}"
      " Fix the model (add --debug for the traceback).",
      file=sys.stderr,
    )
    return 2
  if page is not None:
    try:
      os.makedirs(os.path.dirname(os.path.abspath(html_path)), exist_ok=True)
      with open(html_path, "w", encoding="utf-8") as f:
        f.write(page)
    except OSError as e:
      print(
        f"flaxlens inspect: cannot write the page to {html_path!r} ({e.strerror or e})."
        " Give --html a file path in a folder you can write to.",
        file=sys.stderr,
      )
      return 2
  if as_json:
    data = {"target": target, "framework": loaded.framework, **table.as_dict()}
    print(json.dumps(data, indent=1))
  else:
    # The terminal's width ($COLUMNS first); none when the output goes to a file or a pipe.
    width = shutil.get_terminal_size((0, 0)).columns or None
    heading = f"{target}: {loaded.framework} model, {len(table.rows)} calls"
    # A long target path breaks at a slash (or anywhere) rather than pass the width.
    print("\n".join(textwrap.wrap(heading, width, break_on_hyphens=False)) if width else heading)
    print()
    print(table.text(width))
  if html_path is not None:
    print(f"\nwrote {html_path}", file=sys.stderr if as_json else sys.stdout)
  return 0


def _nothing_shown(tree: Any, path: str, depth: int | None) -> Exception:
  """Why `--path` (with `--depth`) left no row in the table of `tree`: the pattern matches
  only calls nested deeper than `depth`, or no call at all."""
  import flaxlens as fl

  matching = fl.summary(tree, path=path).rows
  if matching:
    deepest = min(row.depth for row in matching)
    shallowest = next(row for row in matching if row.depth == deepest)
    return fl.SelectionError(
      f"The path pattern {path!r} matches {len(matching)} calls ({shallowest.path!r} among"
      f" them), but --depth {depth} leaves out every call nested deeper than {depth} below"
      f" the root, and these are nested {deepest} or more deep. Pass --depth {deepest} or"
      " more, or leave out --depth."
    )
  known = [row.path or "<root>" for row in fl.summary(tree, depth).rows]
  return fl.SelectionError(
    f"No call matches the path pattern {path!r} (calls include {known[:12]}). Use a"
    " pattern as tree.select().at_path takes: `*` within a path segment, `**` across."
  )


def replay(
  path: str, jit: bool | None, allow: list[str], import_path: list[str] | None = None
) -> int:
  """Loads an isolated-call artifact, replays it and prints the per-leaf comparison.

  The allowed packages are imported as `inspect` imports a TARGET's module: from the
  `import_path` folders, the current folder, then the installed packages.

  Exit status: 0 exact replay, 1 replay differs, 2 the artifact was refused or its call
  could not be replayed.
  """
  from rich.console import Console
  from rich.markup import escape

  import flaxlens as fl

  console = Console()
  try:
    isolated = fl.load_isolated(path, allow=allow, import_path=import_path)
  except fl.FlaxlensError as e:  # The artifact, or an --allow that names no package.
    print(f"flaxlens replay: {e}", file=sys.stderr)
    return 2
  try:
    report = isolated.replay(jit=jit)
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # An allowed model's sys.exit(0) is no exact replay.
    print(f"flaxlens replay: the saved call raised {type(e).__name__}: {e}", file=sys.stderr)
    return 2
  width = max((len(row.name) for row in report.rows), default=0)
  for row in report.rows:
    if row.bitwise:
      verdict = "[green]match[/]"
    else:
      note = f" ({escape(row.note)})" if row.note else ""
      verdict = f"[red]MISMATCH max abs {row.max_abs:.3g}{note}[/]"
    console.print(f"{escape(row.name):<{width}}  {verdict}", highlight=False)
  console.print("[bold green]exact replay[/]" if report else "[bold red]replay differs[/]")
  if report.note and not report:
    console.print(f"note: {report.note}", highlight=False)
  return 0 if report else 1


def check(first: str, second: str, import_path: list[str] | None = None) -> int:
  """Compares two models on the first one's example inputs; prints the report.

  `first` is a TARGET, `path/to/file.py:factory` or `package.module:factory`: the
  factory takes no arguments and returns `(nnx_model, args[, kwargs])` or
  `(linen_module, variables, args[, kwargs])`, as for `flaxlens inspect`. `second` is
  another TARGET (its inputs are not used), or a model saved by `fl.save_exported` (an
  Orbax directory or a safetensors file), restored into the first model's structure.

  Exit status: 0 bitwise equal, 1 they differ, 2 a model could not be loaded or run
  (anything the TARGETs' code raises, a `sys.exit()` included).
  """
  import os

  import flaxlens as fl
  from flaxlens._target import is_target, made, said, sentence

  try:
    given = made(first, import_path)
    model = (given.model, *given.variables) if given.variables else given.model
    if not os.path.lexists(second) and not is_target(second):
      raise fl.ExportError(
        f"{second}: there is no such file or directory, and it is not a TARGET"
        " (path/to/file.py:factory or package.module:factory). Give the path"
        " fl.save_exported wrote, or a TARGET."
      )
    if os.path.lexists(second):
      restored = fl.load_exported(second, like=given.variables[0] if given.variables else model)
      other = (given.model, restored) if given.variables else restored
    else:
      made_other = made(second, import_path)
      other = (
        (made_other.model, *made_other.variables) if made_other.variables else made_other.model
      )
  except fl.FlaxlensError as e:
    print(f"flaxlens check: {e}", file=sys.stderr)
    return 2
  kwargs = given.kwargs
  options = {
    "method": kwargs.get("method"),
    "random_streams": kwargs.get("rngs"),
    "mutable": kwargs.get("mutable", False),
  }
  argument = fl.ArgsAndKwargs.capture(*given.args, **given.call_kwargs())
  try:
    report = fl.check_equivalence(model, other, argument, **options)
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # A model's own failure, its `sys.exit()` included.
    print(
      f"flaxlens check: running {first} and {second} on the example inputs of {first}"
      f" raised {sentence(said(e))} Fix the model, or return example inputs both models"
      " accept.",
      file=sys.stderr,
    )
    return 2
  print(report)
  return 0 if report else 1


def features(options: argparse.Namespace) -> int:
  """Writes the page of chosen features of the dictionary DICTIONARY (saved by `fld.save`)
  over the harvest STORE (`fl.harvest`'s path): `fld.feature_views(...).to_html(--out)`.

  Token ids (`--tokens`) and `W_U` (`--unembedding`) are read from `.npy` files (no
  pickled objects), token texts (`--vocabulary`) from a JSON list of strings.

  Exit status: 0 the page is written, 2 an input was refused or the page could not be
  written (the message says what to change).
  """
  import json
  import os

  import numpy as np

  import flaxlens as fl
  import flaxlens.dictionaries as fld

  def array(path: str | None, flag: str) -> np.ndarray | None:
    if path is None:
      return None
    try:
      return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as error:
      raise fl.ArgumentError(
        f"{flag} {path!r} cannot be read as a .npy array ({error}). Save it with"
        " numpy.save (a plain array, no objects)."
      ) from None

  try:
    chosen = _feature_numbers(options.features)
    vocabulary = None
    if options.vocabulary is not None:
      with open(options.vocabulary, "rb") as file:
        raw = file.read(_MAX_VOCABULARY_BYTES + 1)
      vocabulary = json.loads(raw) if len(raw) <= _MAX_VOCABULARY_BYTES else None
      if not isinstance(vocabulary, list):
        raise fl.ArgumentError(
          f"--vocabulary {options.vocabulary!r} is not a JSON list of token texts (of at"
          f" most {_MAX_VOCABULARY_BYTES:,} bytes). Write the texts in id order, as a list."
        )
    views = fld.feature_views(
      fld.load(options.dictionary),
      fl.open_harvest(options.store),
      options.site,
      chosen,
      layer=options.layer,
      tokens=array(options.tokens, "--tokens"),
      vocabulary=vocabulary,
      unembedding=array(options.unembedding, "--unembedding"),
      top=options.top,
    )
    os.makedirs(os.path.dirname(os.path.abspath(options.out)), exist_ok=True)
    views.to_html(options.out)
  except fl.FlaxlensError as error:
    print(f"flaxlens features: {error}", file=sys.stderr)
    return 2
  except (OSError, ValueError) as error:  # A file that cannot be read or written.
    print(
      f"flaxlens features: {error}. Give files that exist and a page path you can write.",
      file=sys.stderr,
    )
    return 2
  print(f"wrote {options.out}")
  return 0


_MAX_VOCABULARY_BYTES = 2**28


def _feature_numbers(text: str) -> list[int]:
  """`"1,2,3"` as `[1, 2, 3]`; refuses anything else."""
  import flaxlens as fl

  try:
    return [int(part) for part in text.split(",")]
  except ValueError:
    raise fl.ArgumentError(
      f"--features {text!r} is not a list of feature numbers. Give them as 1,2,3."
    ) from None


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.command == "demo":  # It says it is importing JAX first.
    return demo(not args.no_cache, args.compilation_cache)
  if not args.no_cache:
    import flaxlens as fl

    fl.enable_compilation_cache(args.compilation_cache)
  if args.command == "features":  # It imports no module by name.
    return features(args)
  with _importing(args.import_path):
    if args.command == "inspect":
      return inspect(
        args.target, args.depth, args.path, args.json, args.html, args.debug, args.import_path
      )
    if args.command == "replay":
      return replay(args.path, args.jit, args.allow, args.import_path)
    if args.command == "check":
      return check(args.first, args.second, args.import_path)
  return 2


def _parser() -> argparse.ArgumentParser:
  """The command line: its commands and their options."""
  parser = argparse.ArgumentParser(
    prog="flaxlens", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  cache = argparse.ArgumentParser(add_help=False)
  where = cache.add_mutually_exclusive_group()
  where.add_argument(
    "--compilation-cache",
    metavar="DIR",
    help="keep compiled programs in DIR (default: $FLAXLENS_COMPILATION_CACHE, else"
    " ~/.cache/flaxlens/jax)",
  )
  where.add_argument(
    "--no-cache", action="store_true", help="compile without JAX's persistent cache"
  )
  commands = parser.add_subparsers(dest="command", required=True)
  commands.add_parser(
    "demo", parents=[cache], help="convert an embedded model, check it, patch and edit it"
  )
  _add_inspect(commands, cache)
  _add_replay(commands, cache)
  _add_check(commands, cache)
  _add_features(commands, cache)
  return parser


def _add_inspect(commands: Any, cache: argparse.ArgumentParser) -> None:
  inspect_parser = commands.add_parser(
    "inspect",
    parents=[cache],
    help="print the calls of a model: paths, classes, shapes, parameters",
    description="Prints the calls of the model TARGET names, in execution order: path,"
    " module class, method, input and output shapes and dtypes, the parameters and state"
    " each module owns, and the totals. TARGET is path/to/file.py:factory or"
    " package.module:factory; the factory takes no arguments and returns"
    " (nnx_model, args[, kwargs]) or (linen_module, variables, args[, kwargs]).",
  )
  inspect_parser.add_argument("target", metavar="TARGET", help="file.py:factory or module:factory")
  inspect_parser.add_argument(
    "--depth", type=int, metavar="N", help="leave out calls nested deeper than N below the root"
  )
  inspect_parser.add_argument(
    "--path",
    metavar="PATTERN",
    help="keep the calls whose path matches PATTERN (`*` within a segment, `**` across,"
    " as tree.select().at_path)",
  )
  inspect_parser.add_argument(
    "--json", action="store_true", help="print the table as JSON, for programs"
  )
  inspect_parser.add_argument(
    "--html", metavar="FILE", help="also write the web page of the tree (fl.to_html) to FILE"
  )
  inspect_parser.add_argument(
    "--debug", action="store_true", help="show the full traceback when the TARGET is wrong"
  )
  _import_path_option(inspect_parser)


def _add_replay(commands: Any, cache: argparse.ArgumentParser) -> None:
  replay_parser = commands.add_parser(
    "replay", parents=[cache], help="re-run a saved isolated call"
  )
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
  _import_path_option(replay_parser)


def _add_check(commands: Any, cache: argparse.ArgumentParser) -> None:
  check_parser = commands.add_parser(
    "check",
    parents=[cache],
    help="compare two models (or a model and a saved export) on example inputs",
    description=check.__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  check_parser.add_argument("first", metavar="TARGET", help="file.py:factory or pkg.mod:factory")
  check_parser.add_argument(
    "second", metavar="OTHER", help="another TARGET, or a path written by fl.save_exported"
  )
  _import_path_option(check_parser)


def _add_features(commands: Any, cache: argparse.ArgumentParser) -> None:
  parser = commands.add_parser(
    "features",
    parents=[cache],
    help="write the page of chosen features of a dictionary over a harvest",
    description=features.__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("store", metavar="STORE", help="the harvest store (fl.harvest's path)")
  parser.add_argument("dictionary", metavar="DICTIONARY", help="the dictionary (fld.save's path)")
  parser.add_argument("--site", required=True, help="the harvested site the dictionary reads")
  parser.add_argument(
    "--features", required=True, metavar="N,N,...", help="the features' numbers, as 1,2,3"
  )
  parser.add_argument("--out", required=True, metavar="FILE", help="the page to write")
  parser.add_argument(
    "--layer", type=int, help="a cross-layer transcoder's layer whose features to view"
  )
  parser.add_argument(
    "--tokens", metavar="FILE.npy", help="the dataset's token ids, [examples, positions]"
  )
  parser.add_argument(
    "--vocabulary", metavar="FILE.json", help="token texts: a JSON list, indexed by id"
  )
  parser.add_argument(
    "--unembedding", metavar="FILE.npy", help="W_U, [d_out, vocabulary], to score tokens"
  )
  parser.add_argument("--top", type=int, default=20, help="top contexts per feature (20)")


def _import_path_option(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
    "--import-path",
    action="append",
    default=[],
    metavar="DIR",
    help="import modules from DIR too (repeatable): modules are found in the --import-path"
    " folders, then the current folder, then the installed packages",
  )


def _importing(import_path: list[str]) -> Any:
  """The context in which a command runs: the `--import-path` folders, then the current
  folder, first on `sys.path` (`tools.files._policy.import_folders`: the one rule for modules
  imported by name), so that what the loaded code imports later is found too."""
  from flaxlens.tools.files._policy import import_folders, importing_from

  return importing_from(import_folders(import_path, "flaxlens"))


if __name__ == "__main__":
  sys.exit(main())
