"""The public surface: `fl.__all__` is the documented set, documented, and nothing else."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import tomllib
from importlib import metadata
from pathlib import Path
from types import ModuleType

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import flaxlens as fl
from flaxlens import errors

API_PAGE = Path(__file__).parents[2] / "docs" / "api.md"


def _documented(namespace: str = "flaxlens") -> list[tuple[str, str]]:
  """`(section, name)` for each `::: NAMESPACE.NAME` of the API reference, in page order."""
  found, section = [], ""
  for line in API_PAGE.read_text().splitlines():
    if line.startswith("## "):
      section = line[3:]
    elif line.startswith(f"::: {namespace}.") and "." not in line.removeprefix(f"::: {namespace}."):
      found.append((section, line.removeprefix(f"::: {namespace}.")))
  return found


PUBLIC = {name for _, name in _documented()}

# Data users receive from flaxlens (and may test with isinstance) but never build or
# call, so they need no example of their own.
RECEIVED_ONLY = {
  "InterceptedFlaxScopeData",
  "AbstractVariable",
  "AbstractVariableSlot",
  "AbstractVariableValue",
  "ParameterSlot",
  "ParameterValue",
  "StateVariableSlot",
  "StateVariableValue",
  "Uninitialized",
}


def test_all_lists_the_names_the_api_reference_documents_in_its_order():
  assert fl.__all__ == [name for _, name in _documented()]


# The top level holds the everyday verbs; a research family (dictionaries, attribution
# graphs) or an audience of its own (extension authors: `flaxlens.extend`) gets a public
# module, so `fl.<tab>` stays learnable (docs/architecture.md, "The public surface").
TOP_LEVEL_AT_MOST = 100


def test_the_top_level_stays_the_everyday_verbs():
  assert len(fl.__all__) <= TOP_LEVEL_AT_MOST, (
    f"fl has {len(fl.__all__)} names: put a new family in a module of its own"
  )


@pytest.mark.parametrize("namespace", ["extend", "dictionaries", "graphs"])
def test_a_namespace_lists_what_its_api_section_documents_with_docstrings(namespace):
  module = importlib.import_module(f"flaxlens.{namespace}")
  assert module.__all__ == [name for _, name in _documented(f"flaxlens.{namespace}")]
  for name in module.__all__:
    assert inspect.getdoc(getattr(module, name)), name
    assert getattr(module, name).__module__.startswith("flaxlens."), name


def test_every_public_name_is_listed_once():
  assert len(fl.__all__) == len(set(fl.__all__))
  assert len(_documented()) == len(PUBLIC)


def test_all_is_grouped_by_the_sections_of_the_api_reference():
  source = inspect.getsource(fl)
  listed = source[source.index("__all__ = [") :]
  comments = [line.strip()[2:] for line in listed.splitlines() if line.strip().startswith("# ")]
  sections = list(dict.fromkeys(section for section, _ in _documented()))
  assert [c.rstrip(".") for c in comments] == sections


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_name_is_importable(name):
  namespace = {}
  exec(f"from flaxlens import {name}", namespace)
  assert namespace[name] is getattr(fl, name)


def test_metadata_classes_are_not_public_but_stay_importable():
  from flaxlens.linen._node import RngSnapshot
  from flaxlens.nnx._definition import NNXModuleDef
  from flaxlens.nnx._node import NNXVariableSpec

  for cls in (RngSnapshot, NNXModuleDef, NNXVariableSpec):
    assert not hasattr(fl, cls.__name__)


def test_no_public_name_is_a_module_or_comes_from_outside_flaxlens():
  for name in fl.__all__:
    value = getattr(fl, name)
    assert not isinstance(value, ModuleType), name
    assert value.__module__.split(".")[0] == "flaxlens", name


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_name_has_a_docstring(name):
  assert inspect.getdoc(getattr(fl, name)), name


@pytest.mark.parametrize(
  "name",
  sorted(
    n
    for n in PUBLIC - RECEIVED_ONLY
    if not (isinstance(getattr(fl, n), type) and issubclass(getattr(fl, n), Exception))
  ),
)
def test_every_public_function_and_class_users_call_has_an_example(name):
  assert ">>>" in inspect.getdoc(getattr(fl, name)), name


def _flaxlens_modules():
  for info in pkgutil.walk_packages(fl.__path__, "flaxlens."):
    yield importlib.import_module(info.name)


def test_every_exception_flaxlens_defines_is_a_flaxlens_error_in_the_errors_module():
  defined = {
    value
    for module in _flaxlens_modules()
    for value in vars(module).values()
    if isinstance(value, type)
    and issubclass(value, BaseException)
    and not issubclass(value, Warning)
    and value.__module__.startswith("flaxlens")
  }
  assert defined, "no flaxlens exception found"
  for cls in defined:
    assert issubclass(cls, fl.FlaxlensError), cls
    assert cls.__module__ == "flaxlens.errors", cls


def test_the_errors_module_documents_every_public_error():
  public_errors = {
    name
    for name in fl.__all__
    if isinstance(getattr(fl, name), type) and issubclass(getattr(fl, name), Exception)
  }
  defined = {
    name
    for name, value in vars(errors).items()
    if isinstance(value, type) and issubclass(value, Exception)
  }
  assert public_errors == defined
  for name in defined - {"FlaxlensError"}:
    assert f"`{name}`" in errors.__doc__, name


def test_version_comes_from_the_package_metadata_of_pyproject():
  pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
  assert fl.__version__ == metadata.version("flaxlens") == pyproject["project"]["version"]


def test_struct_from_attributes_with_unknown_fields_is_an_argument_error():
  class Pair(fl.Struct):
    left: int
    right: int

  with pytest.raises(fl.ArgumentError, match=r"unexpected \['middle'\]"):
    Pair.from_attributes(left=1, right=2, middle=3)


def test_invalid_random_streams_are_an_argument_error_naming_the_module():
  model, x = nn.Dropout(0.5, deterministic=False), jnp.ones((2, 3))
  rngs = {"dropout": jax.random.key(0)}
  tree = fl.unflaxify(model, {}, x, rngs=rngs)
  with pytest.raises(fl.ArgumentError, match="Dropout: the random streams") as info:
    tree(fl.ArgsAndKwargs.capture(x), random_streams=5)
  assert isinstance(info.value, TypeError)
