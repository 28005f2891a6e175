"""`InterceptedFlaxScopeData`: a converted call's own variables, the same shape for Linen and NNX.

Every call node holds its module's variables (not its children's) in one
`InterceptedFlaxScopeData`, grouped as Flax groups them: parameters, mutable variables by
collection, immutable variables by collection, and the rng state of a call cut out of a
larger model. `ScopeBuilder` assigns the variables a converter found to the calls that
own them. No Flax internals here.
"""

from __future__ import annotations

from typing import Any

from flaxlens.core._names import join_name
from flaxlens.core._readonly import ReadOnlyDict, read_only
from flaxlens.core._struct import Struct

Path = tuple[Any, ...]


class InterceptedFlaxScopeData(Struct):
  """A Flax module's own variables (not its children's), as seen by one call.

  Keys are names relative to the module (`"kernel"`); a variable of a submodule that
  never makes a call of its own is held by its nearest calling ancestor under its
  relative path (`"Dense_0/kernel"`). Names are paths of keys joined by "/", with "~"
  and "/" inside a key written "~0" and "~1" (RFC 6901), so a Flax name that contains
  "/" stays one key: `nn.WeightNorm`'s `"Dense_0/kernel/scale"` reads
  `"Dense_0~1kernel~1scale"`. Labels read `"collection:path"` for Linen and
  `"VariableType:path"` for NNX, spelled the same way.

  Collections: Linen's are the `apply` collections. An NNX variable's collection is the
  name NNX's registry gives its exact type (`nnx.register_variable_name`, as
  `nnx.bridge` and Linen interop use it: `batch_stats` for `nnx.BatchStat`, `cache` for
  `nnx.Cache`, `intermediates` for `nnx.Intermediate`, `perturbations`), else the
  type's class name, as `nnx.bridge` registers an unknown type (`RngKey`, `RngCount`,
  your own `class Count(nnx.Variable)`).

  Attributes:
    parameters: the `params` collection (Linen) or the `nnx.Param`s (NNX), as
      `Parameter`s.
    variables: mutable collections, `{collection: {name: StateVariable}}`; for NNX
      every variable that is not an `nnx.Param`.
    immutable_variables: other collections, `{collection: {name: value}}` (Linen
      collections the apply does not treat as mutable; always empty for NNX).
    rngs: None when the call takes its keys from the enclosing call (as every call of a
      converted tree does); for a Linen call cut out of a larger model, an `RngSnapshot`
      so that on its own it draws the keys it drew there (and binds the modules it held
      but the model had bound elsewhere as they were bound there). (NNX keeps its rng
      state in `RngKey`/`RngCount` variables.)

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> from flax import nnx
    >>> model = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    >>> data = fl.unflaxify(model, jnp.ones((1, 2))).scope_data
    >>> sorted(data.parameters), sorted(data.variables["batch_stats"])
    (['bias', 'scale'], ['mean', 'var'])
  """

  parameters: dict[str, Any]
  variables: dict[str, dict[str, Any]]
  immutable_variables: dict[str, dict[str, Any]]
  rngs: Any = None


class ScopeBuilder:
  """Collects the variables of a converted model into the scope data of their owners."""

  def __init__(self, called: set[Path]):
    self.called = frozenset(called)
    self._data = {path: ({}, {}, {}) for path in called}

  def owner(self, path: Path) -> Path:
    """The called module path owning the variable at `path`; see `owner_of`."""
    return owner_of(path, self.called)

  def add(self, path: Path, collection: str | None, entry: Any, mutable: bool = True) -> str:
    """Puts `entry` (the variable at `path`) into its owner's data; returns its name.

    `collection` None means a parameter; otherwise the entry goes into `variables` (or
    `immutable_variables` when not `mutable`) under `collection`.
    """
    owner = self.owner(path)
    name = join_name(path[len(owner) :])
    parameters, variables, immutable = self._data[owner]
    if collection is None:
      parameters[name] = entry
    else:
      (variables if mutable else immutable).setdefault(collection, {})[name] = entry
    return name

  def scope_data(self, path: Path) -> InterceptedFlaxScopeData:
    """A new `InterceptedFlaxScopeData` for the call at `path` (fresh dicts each time)."""
    parameters, variables, immutable = self._data[path]
    return InterceptedFlaxScopeData(
      parameters=read_only(parameters),
      variables=read_only(variables),
      immutable_variables=read_only(immutable),
    )


def fixed_scope_data(data: Any) -> bool:
  """Whether no entry of `data` (an `InterceptedFlaxScopeData`) can be added or swapped:
  its dicts, and the collection dicts in them, are all read-only."""
  if not isinstance(data, InterceptedFlaxScopeData):
    return False
  groups = (data.parameters, data.variables, data.immutable_variables)
  return all(type(g) is ReadOnlyDict for g in groups) and all(
    type(c) is ReadOnlyDict for g in groups[1:] for c in g.values()
  )


def owner_of(path: Path, called: set[Path] | frozenset[Path]) -> Path:
  """The longest called module path that is a proper prefix of a variable's `path`.

  A variable belongs to its module's calls, or, if that module makes no call of its
  own, to the calls of its nearest calling ancestor (the root always calls).

  Example:
    >>> from flaxlens.core._call_variables import owner_of
    >>> owner_of(("Block_0", "Dense_0", "kernel"), {(), ("Block_0",)})
    ('Block_0',)
  """
  for end in range(len(path) - 1, 0, -1):
    if path[:end] in called:
      return path[:end]
  return ()
