"""flaxlens: turn any Flax model into an explicit tree of layers you can see and edit.

Each public name is imported once below, as `from module import name as name` (the
explicit re-export type checkers honour), grouped by job in the order of the API
reference (docs/api.md), and `__all__` lists exactly those names, in the same groups.
The modules they come from are private and may change; `flaxlens.errors` is public too,
its docstring says when each error is raised and what to do.
"""

# isort: off
from importlib import metadata as _metadata

from flaxlens.core import _render

# Converting and calling a model.
from flaxlens._unflaxify import unflaxify as unflaxify
from flaxlens.core._args import ArgsAndKwargs as ArgsAndKwargs
from flaxlens.core._random import RandomStream as RandomStream
from flaxlens.core._node import CallNode as CallNode
from flaxlens.linen._node import InterceptedFlaxModuleMethod as InterceptedFlaxModuleMethod
from flaxlens.nnx._node import InterceptedNNXModuleMethod as InterceptedNNXModuleMethod
from flaxlens.core._call_variables import InterceptedFlaxScopeData as InterceptedFlaxScopeData

# Trees: structs, layers, selections.
from flaxlens.core._struct import Struct as Struct
from flaxlens.core._struct import static_field as static_field
from flaxlens.core._layer import Layer as Layer
from flaxlens.core._selectors import Selection as Selection
from flaxlens.core._selectors import select as select

# Variables.
from flaxlens.core._variables import Parameter as Parameter
from flaxlens.core._variables import StateVariable as StateVariable
from flaxlens.core._variables import AbstractVariable as AbstractVariable
from flaxlens.core._variables import AbstractVariableSlot as AbstractVariableSlot
from flaxlens.core._variables import AbstractVariableValue as AbstractVariableValue
from flaxlens.core._variables import ParameterSlot as ParameterSlot
from flaxlens.core._variables import ParameterValue as ParameterValue
from flaxlens.core._variables import StateVariableSlot as StateVariableSlot
from flaxlens.core._variables import StateVariableValue as StateVariableValue
from flaxlens.core._variables import Uninitialized as Uninitialized
from flaxlens.core._variables import bind_variables as bind_variables
from flaxlens.core._variables import unbind_variables as unbind_variables
from flaxlens.core._variables import freeze_variables as freeze_variables
from flaxlens.core._variables import relabel_variables as relabel_variables
from flaxlens.core._variables import variables_in as variables_in
from flaxlens.core._jit import variable_jit as variable_jit

# Compiling.
from flaxlens.core._compilation import enable_compilation_cache as enable_compilation_cache
from flaxlens.core._compilation import disable_compilation_cache as disable_compilation_cache
from flaxlens.core._compilation import count_compiles as count_compiles
from flaxlens.core._compilation import CompileCount as CompileCount

# Inspecting.
from flaxlens.tools.view._summary import summary as summary
from flaxlens.tools.view._html import to_html as to_html

# Capturing and intervening.
from flaxlens.tools.base._probed import run as run
from flaxlens.tools.base._probed import capture as capture
from flaxlens.tools.base._intervention import Intervention as Intervention
from flaxlens.tools.analysis._interventions import ablate as ablate
from flaxlens.tools.analysis._interventions import patch as patch
from flaxlens.tools.analysis._interventions import steer as steer
from flaxlens.tools.analysis._interventions import scale as scale
from flaxlens.tools.analysis._interventions import modify as modify
from flaxlens.tools.base._probed import place as place
from flaxlens.core._edit import EditedCall as EditedCall
from flaxlens.tools.analysis._heads import heads as heads
from flaxlens.tools.analysis._heads import Heads as Heads
from flaxlens.tools.analysis._attention_pattern import attention_pattern as attention_pattern
from flaxlens.tools.analysis._attention_pattern import AttentionPattern as AttentionPattern
from flaxlens.tools.analysis._experts import experts as experts
from flaxlens.tools.analysis._experts_routing import routing as routing
from flaxlens.tools.analysis._sweeps import sweep as sweep
from flaxlens.tools.analysis._sweep_result import SweepResult as SweepResult
from flaxlens.tools.analysis._attribution import attribute as attribute
from flaxlens.tools.analysis._attribution import grad_at as grad_at
from flaxlens.tools.analysis._paths import path_patch as path_patch
from flaxlens.tools.analysis._paths import Sites as Sites
from flaxlens.tools.files._specs import save_interventions as save_interventions
from flaxlens.tools.files._specs import load_interventions as load_interventions

# Lenses and splicing.
from flaxlens.tools.analysis._lens import lens as lens
from flaxlens.tools.analysis._lens import LensResult as LensResult
from flaxlens.tools.analysis._splice import splice as splice

# Exporting and comparing.
from flaxlens.tools.export._fold import fold as fold
from flaxlens.tools.export._equivalence import check_equivalence as check_equivalence
from flaxlens.tools.base._compare import EquivalenceReport as EquivalenceReport
from flaxlens.tools.export._saving import save_exported as save_exported
from flaxlens.tools.export._saving import load_exported as load_exported

# Training interventions.
from flaxlens.tools.analysis._interventions import low_rank_edit as low_rank_edit
from flaxlens.tools.analysis._interventions import interchange as interchange
from flaxlens.tools.analysis._training import train_interventions as train_interventions

# Isolating, saving and replaying.
from flaxlens.tools.isolation._isolate import isolate as isolate
from flaxlens.tools.isolation._replay import IsolatedSubmodel as IsolatedSubmodel
from flaxlens.tools.files._artifact import save_isolated as save_isolated
from flaxlens.tools.files._artifact import load_isolated as load_isolated
from flaxlens.tools.files._codec import register_value_codec as register_value_codec

# Harvesting.
from flaxlens.tools.harvest._harvest import harvest as harvest
from flaxlens.tools.harvest._store import open_harvest as open_harvest
from flaxlens.tools.harvest._store import Harvest as Harvest

# Errors.
from flaxlens.errors import FlaxlensError as FlaxlensError
from flaxlens.errors import ArgumentError as ArgumentError
from flaxlens.errors import ArtifactError as ArtifactError
from flaxlens.errors import BudgetError as BudgetError
from flaxlens.errors import ExportError as ExportError
from flaxlens.errors import HarvestError as HarvestError
from flaxlens.errors import HeadsError as HeadsError
from flaxlens.errors import ModelCallError as ModelCallError
from flaxlens.errors import CallStructureError as CallStructureError
from flaxlens.errors import ReplacementError as ReplacementError
from flaxlens.errors import SelectionError as SelectionError
from flaxlens.errors import StatisticsError as StatisticsError
from flaxlens.errors import TrainingError as TrainingError
from flaxlens.errors import UnsupportedFlaxFeatureError as UnsupportedFlaxFeatureError
from flaxlens.errors import VariableError as VariableError
from flaxlens.errors import MetricRetraceWarning as MetricRetraceWarning
# isort: on

__version__ = _metadata.version("flaxlens")

__all__ = [
  # Converting and calling a model.
  "unflaxify",
  "ArgsAndKwargs",
  "RandomStream",
  "CallNode",
  "InterceptedFlaxModuleMethod",
  "InterceptedNNXModuleMethod",
  "InterceptedFlaxScopeData",
  # Trees: structs, layers, selections.
  "Struct",
  "static_field",
  "Layer",
  "Selection",
  "select",
  # Variables.
  "Parameter",
  "StateVariable",
  "AbstractVariable",
  "AbstractVariableSlot",
  "AbstractVariableValue",
  "ParameterSlot",
  "ParameterValue",
  "StateVariableSlot",
  "StateVariableValue",
  "Uninitialized",
  "bind_variables",
  "unbind_variables",
  "freeze_variables",
  "relabel_variables",
  "variables_in",
  "variable_jit",
  # Compiling.
  "enable_compilation_cache",
  "disable_compilation_cache",
  "count_compiles",
  "CompileCount",
  # Inspecting.
  "summary",
  "to_html",
  # Capturing and intervening.
  "run",
  "capture",
  "Intervention",
  "ablate",
  "patch",
  "steer",
  "scale",
  "modify",
  "place",
  "EditedCall",
  "heads",
  "Heads",
  "attention_pattern",
  "AttentionPattern",
  "experts",
  "routing",
  "sweep",
  "SweepResult",
  "path_patch",
  "Sites",
  "attribute",
  "grad_at",
  "save_interventions",
  "load_interventions",
  # Lenses and splicing.
  "lens",
  "LensResult",
  "splice",
  # Exporting and comparing.
  "fold",
  "check_equivalence",
  "EquivalenceReport",
  "save_exported",
  "load_exported",
  # Training interventions.
  "low_rank_edit",
  "interchange",
  "train_interventions",
  # Isolating, saving and replaying.
  "isolate",
  "IsolatedSubmodel",
  "save_isolated",
  "load_isolated",
  "register_value_codec",
  # Harvesting.
  "harvest",
  "open_harvest",
  "Harvest",
  # Errors.
  "FlaxlensError",
  "ArgumentError",
  "ArtifactError",
  "BudgetError",
  "ExportError",
  "HarvestError",
  "HeadsError",
  "ModelCallError",
  "CallStructureError",
  "ReplacementError",
  "SelectionError",
  "StatisticsError",
  "TrainingError",
  "UnsupportedFlaxFeatureError",
  "VariableError",
  "MetricRetraceWarning",
]

_render.register_handlers()
