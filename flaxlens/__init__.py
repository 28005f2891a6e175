"""flaxlens: turn any Flax model into an explicit tree of layers you can see and edit."""

from flaxlens._errors import (
  ArgumentError,
  CallStructureError,
  FlaxlensError,
  ReplacementError,
  SelectionError,
  UnsupportedFlaxFeatureError,
  VariableError,
)
from flaxlens._unflaxify import unflaxify
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._jit import variable_jit
from flaxlens.core._layer import Layer
from flaxlens.core._node import CallNode
from flaxlens.core._random import RandomStream
from flaxlens.core._scope import InterceptedFlaxScopeData
from flaxlens.core._selectors import Selection, select
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._variables import (
  AbstractVariable,
  AbstractVariableSlot,
  AbstractVariableValue,
  Parameter,
  ParameterSlot,
  ParameterValue,
  StateVariable,
  StateVariableSlot,
  StateVariableValue,
  Uninitialized,
  bind_variables,
  freeze_variables,
  relabel_variables,
  unbind_variables,
  variables_in,
)
from flaxlens.linen._node import InterceptedFlaxModuleMethod, RngSnapshot
from flaxlens.nnx._definition import NNXModuleDef
from flaxlens.nnx._node import InterceptedNNXModuleMethod, NNXVariableSpec
from flaxlens.tools._artifact import load_isolated, save_isolated
from flaxlens.tools._codec import register_value_codec
from flaxlens.tools._isolate import isolate, isolate_calls, isolate_submodel
from flaxlens.tools._policy import ArtifactError
from flaxlens.tools._replay import IsolatedSubmodel, ReplayReport
from flaxlens.tools._summary import summary

__version__ = "0.1.0"

__all__ = [
  "ArtifactError",
  "load_isolated",
  "register_value_codec",
  "save_isolated",
  "ArgsAndKwargs",
  "ArgumentError",
  "CallNode",
  "CallStructureError",
  "FlaxlensError",
  "InterceptedFlaxModuleMethod",
  "InterceptedFlaxScopeData",
  "IsolatedSubmodel",
  "ReplacementError",
  "ReplayReport",
  "RngSnapshot",
  "InterceptedNNXModuleMethod",
  "NNXModuleDef",
  "NNXVariableSpec",
  "Uninitialized",
  "UnsupportedFlaxFeatureError",
  "unflaxify",
  "AbstractVariable",
  "AbstractVariableSlot",
  "AbstractVariableValue",
  "Layer",
  "Parameter",
  "ParameterSlot",
  "ParameterValue",
  "RandomStream",
  "Selection",
  "SelectionError",
  "StateVariable",
  "StateVariableSlot",
  "StateVariableValue",
  "Struct",
  "VariableError",
  "bind_variables",
  "freeze_variables",
  "isolate",
  "isolate_calls",
  "isolate_submodel",
  "relabel_variables",
  "select",
  "static_field",
  "summary",
  "unbind_variables",
  "variable_jit",
  "variables_in",
]
