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

PUBLIC = {
  # Converting and calling a model.
  "unflaxify",
  "ArgsAndKwargs",
  "RandomStream",
  "CallNode",
  "InterceptedFlaxModuleMethod",
  "InterceptedFlaxScopeData",
  "InterceptedNNXModuleMethod",
  # Trees: structs, layers, selections.
  "Struct",
  "static_field",
  "Layer",
  "Selection",
  "select",
  # Variables.
  "AbstractVariable",
  "AbstractVariableSlot",
  "AbstractVariableValue",
  "Parameter",
  "ParameterSlot",
  "ParameterValue",
  "StateVariable",
  "StateVariableSlot",
  "StateVariableValue",
  "Uninitialized",
  "bind_variables",
  "freeze_variables",
  "relabel_variables",
  "unbind_variables",
  "variables_in",
  "variable_jit",
  # Tools: isolate, artifacts, summary, the web page.
  "IsolatedSubmodel",
  "EquivalenceReport",
  "check_equivalence",
  "fold",
  "ReplayReport",
  "isolate",
  "isolate_calls",
  "isolate_submodel",
  "load_isolated",
  "load_exported",
  "save_exported",
  "save_isolated",
  "register_value_codec",
  "summary",
  # interventions and captures
  "Intervention",
  "ablate",
  "capture",
  "modify",
  "place",
  "EditedCall",
  "patch",
  "run",
  "scale",
  "steer",
  "load_interventions",
  "save_interventions",
  "to_html",
  # sweeps, attribution patching, gradients at calls
  "SweepResult",
  "attribute",
  "grad_at",
  "sweep",
  # Errors.
  "FlaxlensError",
  "ArgumentError",
  "ArtifactError",
  "CallStructureError",
  "ExportError",
  "ModelCallError",
  "ReplacementError",
  "SelectionError",
  "UnsupportedFlaxFeatureError",
  "VariableError",
}

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


def test_all_is_exactly_the_documented_public_set():
  assert sorted(fl.__all__) == sorted(PUBLIC)


def test_every_public_name_is_listed_once():
  assert len(fl.__all__) == len(set(fl.__all__))


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
  pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
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
