"""Loading the model a `flaxlens inspect TARGET` names, and converting it.

A TARGET is `path/to/file.py:factory` or `package.module:factory`. The factory is called
with no arguments and returns a model with example inputs, in one of two forms:

- NNX: `(model, args)` or `(model, args, kwargs)`, `model` an `nnx.Module`;
- Linen: `(module, variables, args)` or `(module, variables, args, kwargs)`, `module`
  an unbound `nn.Module` and `variables` what `module.init` returns.

`args` is a tuple (or list) of example positional arguments and `kwargs` a dict of
example keyword arguments, which may also hold `fl.unflaxify`'s options (`method=`, and
for Linen `rngs=`, `mutable=`, `capture_intermediates=`). Loading a file runs it, as
`python file.py` would (its folder goes first on `sys.path`, so it can import its
neighbours): name only files you trust. A module is imported from the folders given
with `--import-path`, the current folder, then the installed packages: the one rule
`flaxlens replay` follows too (`tools.files._policy.import_folders`). Every way a TARGET can be
wrong raises a `FlaxlensError` whose message says what to change, and names the TARGET
when its own code fails: any exception but `KeyboardInterrupt` (a `sys.exit()` in the
file, the factory or the model included) is such a failure. `made` reads the factory's
result for every command (`inspect`, `check`); `load` converts it. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax import nnx

from flaxlens._unflaxify import unflaxify
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.errors import FlaxlensError, ModelCallError
from flaxlens.linen._convert import unflaxify_linen
from flaxlens.nnx._convert import unflaxify_nnx
from flaxlens.tools.files._policy import import_folders, importing_from, missing_module

PROTOCOL = (
  "The factory takes no arguments and returns (nnx_model, args) or (nnx_model, args,"
  " kwargs) for NNX, or (linen_module, variables, args) or (linen_module, variables,"
  " args, kwargs) for Linen, where args is a tuple of example positional arguments and"
  " kwargs a dict of example keyword arguments."
)


@dataclasses.dataclass(frozen=True)
class Made:
  """What a TARGET's factory returned, read as `PROTOCOL` says.

  Attributes:
    framework: `"NNX"` or `"Linen"`.
    model: the NNX module or the unbound Linen module.
    variables: `(variables,)` for Linen, `()` for NNX.
    args: the example positional arguments.
    kwargs: the example keyword arguments, `fl.unflaxify`'s options included.
  """

  framework: str
  model: Any
  variables: tuple[Any, ...]
  args: tuple
  kwargs: dict[str, Any]

  def options(self) -> set[str]:
    """The names among `kwargs` that are conversion options, not the call's arguments."""
    return _options(unflaxify_linen if self.framework == "Linen" else unflaxify_nnx)

  def call_kwargs(self) -> dict[str, Any]:
    """`kwargs` without the conversion options: what the model's call takes."""
    options = self.options()
    return {k: v for k, v in self.kwargs.items() if k not in options}


@dataclasses.dataclass(frozen=True)
class Target:
  """A converted TARGET: the tree, and the argument and side inputs of its root call."""

  tree: Any
  argument: ArgsAndKwargs
  side_inputs: dict[str, Any]
  framework: str


def is_target(text: str) -> bool:
  """Whether `text` is written as a TARGET: `where:factory`, the factory an identifier."""
  where, colon, name = text.rpartition(":")
  return bool(colon and where and name.isidentifier())


def load_factory(target: str, import_path: Any = None) -> Callable[[], Any]:
  """The factory `target` names (`file.py:factory` or `package.module:factory`).

  A module is imported as `_policy.import_folders` says (the `import_path` folders, the
  current folder, then `sys.path`); a file is run with its folder first on `sys.path`.
  """
  if not is_target(target):
    raise FlaxlensError(
      f"{target!r} is not a TARGET. Write path/to/file.py:factory or"
      " package.module:factory, naming a function that returns a model and example inputs."
    )
  where, _, name = target.rpartition(":")
  folders = import_folders(import_path, "flaxlens")
  module = _load_file(where) if _is_file(where) else _import(where, folders)
  factory = getattr(module, name, None)
  if factory is None:
    defined = sorted(
      n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
    )
    raise FlaxlensError(
      f"{where} has no {name!r} (its functions: {defined[:12]}). Name one of them after"
      " the colon, or define the factory there."
    )
  if not callable(factory):
    raise FlaxlensError(
      f"{where}:{name} is a {type(factory).__name__}, not a function. Name a function"
      f" that takes no arguments. {PROTOCOL}"
    )
  return factory


def _is_file(where: str) -> bool:
  return where.endswith(".py") or os.sep in where or "/" in where


def _load_file(path: str) -> Any:
  if not os.path.isfile(path):
    raise FlaxlensError(
      f"There is no file {path!r} (looked from {os.getcwd()}). Give the path of a Python"
      " file, relative to the current folder or absolute."
    )
  name = f"_flaxlens_target_{os.path.splitext(os.path.basename(path))[0]}"
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
  sys.modules[name] = module  # Dataclasses (Linen modules) look their module up here.
  try:
    spec.loader.exec_module(module)
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # A `sys.exit()` in the file is no model either.
    del sys.modules[name]
    raise FlaxlensError(
      f"Running {path} raised {said(e)}. Fix the file so that"
      f" `python {path}` runs (add --debug for the traceback)."
    ) from e
  return module


def _import(name: str, folders: tuple[str, ...]) -> Any:
  package = name.partition(".")[0]
  try:
    with importing_from(folders):
      return importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name == package:
      raise FlaxlensError(
        f"Cannot import {name!r}: {missing_module(package, folders, '--import-path DIR')}"
        " Or name a file instead: path/to/file.py:factory."
      ) from e
    raise FlaxlensError(
      f"Cannot import {name!r} ({e}). Install the package, run from the folder that holds"
      " it, or name a file instead: path/to/file.py:factory."
    ) from e
  except KeyboardInterrupt:
    raise
  except BaseException as e:
    raise FlaxlensError(
      f"Importing {name} raised {said(e)}. Fix the module so that"
      f" `python -c 'import {name}'` runs (add --debug for the traceback)."
    ) from e


def made(target: str, import_path: Any = None) -> Made:
  """Calls the factory `target` names and reads what it returns (`PROTOCOL`)."""
  factory = load_factory(target, import_path)
  try:
    result = factory()
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # A factory's `sys.exit()` is a failure, not a success.
    raise FlaxlensError(
      f"{target}() raised {said(e)}. Fix the factory (add --debug for the traceback). {PROTOCOL}"
    ) from e
  return Made(*_unpack(target, result))


def load(target: str, import_path: Any = None) -> Target:
  """Calls the factory `target` names, checks what it returns and converts the model."""
  given = made(target, import_path)
  framework, model, kwargs = given.framework, given.model, given.kwargs
  side_inputs = {"random_streams": kwargs["rngs"]} if kwargs.get("rngs") is not None else {}
  try:
    tree = unflaxify(model, *given.variables, *given.args, **kwargs)
  except ModelCallError as e:  # The model's own code failed on the factory's inputs.
    raise FlaxlensError(
      f"{target}: {said(e, name=False)} Return example inputs the model accepts: the"
      f" factory's args and kwargs must be what {_call_form(framework)} takes (add"
      " --debug for the traceback)."
    ) from e
  except FlaxlensError as e:  # Its message names the call and the fix.
    raise FlaxlensError(f"{target}: {said(e, name=False)}") from e
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # Also the model's own `sys.exit()`.
    raise FlaxlensError(
      f"{target}: converting the {framework} model {type(model).__name__} with the"
      f" example inputs failed with {sentence(said(e))} Return example inputs the"
      f" model accepts: the factory's args and kwargs must be what"
      f" {_call_form(framework)} takes (add --debug for the traceback)."
    ) from e
  argument = ArgsAndKwargs.capture(*given.args, **given.call_kwargs())
  return Target(tree, argument, side_inputs, framework)


def said(error: BaseException, name: bool = True) -> str:
  """`"TypeError: what it said"` in one line, for a one-paragraph message."""
  text = " ".join(str(error).split())
  if isinstance(error, SystemExit):
    text = f"{text or None} (the code called sys.exit())"
  return f"{type(error).__name__}: {text}" if name else text


def sentence(text: str) -> str:
  """`text` ending with a full stop."""
  return text if text.endswith(".") else f"{text}."


def _options(convert: Callable[..., Any]) -> set[str]:
  """The conversion options of a framework's converter: its keyword-only parameters."""
  parameters = inspect.signature(convert).parameters.values()
  return {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _call_form(framework: str) -> str:
  if framework == "Linen":
    return "module.apply(variables, *args, **kwargs)"
  return "model(*args, **kwargs)"


def _unpack(target: str, made: Any) -> tuple[str, Any, tuple[Any, ...], tuple, dict]:
  """`(framework, model, (variables,) or (), args, kwargs)` from the factory's result."""
  if not isinstance(made, tuple) or not made:
    raise FlaxlensError(f"{target}() returned a {type(made).__name__}, not a tuple. {PROTOCOL}")
  model, *rest = made
  if isinstance(model, nnx.Module) and len(rest) in (1, 2):
    framework, variables = "NNX", ()
  elif isinstance(model, nn.Module) and len(rest) in (2, 3):
    framework, variables = "Linen", (rest.pop(0),)
  else:
    kinds = ", ".join(type(x).__name__ for x in made)
    raise FlaxlensError(f"{target}() returned ({kinds}). {PROTOCOL}")
  args, kwargs = rest[0], rest[1] if len(rest) == 2 else {}
  if not isinstance(args, tuple | list) or not isinstance(kwargs, dict):
    raise FlaxlensError(
      f"{target}() returned args of type {type(args).__name__} and kwargs of type"
      f" {type(kwargs).__name__}; args must be a tuple and kwargs a dict (write (x,) for"
      f" one argument). {PROTOCOL}"
    )
  return framework, model, variables, tuple(args), kwargs
