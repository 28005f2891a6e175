"""The Linen call node: `InterceptedFlaxModuleMethod`, one per intercepted call.

Calling a node runs its Flax module with `module.apply` once, natively, under a method
interceptor (`_interceptor`), through the framework-neutral runtime (`core._runtime`)
and the Linen adapter (`_adapter`). Each submodule call Flax makes is matched to the
node's `submodule_calls` entry by `(call_index, "Child.method")`: an unmodified node lets
the call continue natively (so rng derivation, lifted transforms and mutable collections
are Flax's own, bit for bit); any other layer replaces the call and receives its
`ArgsAndKwargs`. Per-node re-application (Penzai's design) was rejected: it changes rng
derivation and cannot run inside `nn.scan`/`nn.vmap` bodies. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flaxlens.core._adapter import adapter_of
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._call_variables import InterceptedFlaxScopeData
from flaxlens.core._names import Path
from flaxlens.core._node import CallNode
from flaxlens.core._runtime import run_tree
from flaxlens.core._spec import CallSpec
from flaxlens.core._struct import Struct, static_field


class RngSnapshot(Struct):
  """The rng state a Flax scope had when a call started: keys, suffixes and counters.

  Attributes:
    keys: the stream keys, `{stream: key}`.
    suffixes: per stream, the names Flax folds into its key lazily.
    counters: the scope's draw counters, including those of child scopes.
    adopted: the modules the call held but Flax had bound elsewhere (`AdoptedModule`s),
      with their own rng states.
    compact_cursor: for a call made inside a compact method of its module (a helper
      method such as `nn.WeightNorm._l2_normalize`, which may make parameters), the
      module's autoname counters then; None otherwise.
  """

  keys: dict[str, Any]
  suffixes: tuple[tuple[str, tuple[Any, ...]], ...] = static_field()
  counters: Any = static_field()
  adopted: tuple[AdoptedModule, ...] = ()
  compact_cursor: tuple[tuple[str, int], ...] | None = static_field(default=None)

  def as_flax(self) -> tuple[dict[str, Any], dict[str, tuple], dict]:
    return dict(self.keys), dict(self.suffixes), self.counters

  def adopted_as_flax(self, rngs: bool = True) -> tuple[tuple[tuple[str, ...], str, Any], ...]:
    """`(path, name, rng state or None)` per adopted module, as `apply_fresh` takes them."""
    return tuple((a.path, a.name, a.rngs.as_flax() if rngs else None) for a in self.adopted)


class AdoptedModule(Struct):
  """A module a call held in an attribute but Flax had bound elsewhere in its model.

  Cut out of the model, the call's module adopts it (Flax binds it under the attribute's
  name). So that it behaves as it did there, a replay binds it at that place under its
  own name, and its scope starts from the rng state it had when the call started.

  Attributes:
    path: where the call's module adopts it (`("inner",)`).
    name: its own name in the model (`"Dropout_0"`).
    rngs: its scope's rng state when the call started.
  """

  path: tuple[str, ...] = static_field()
  name: str = static_field()
  rngs: RngSnapshot


class InterceptedFlaxModuleMethod(CallNode):
  """One call of a Flax Linen module method, with its submodule calls as children.

  Call it as `node(fl.ArgsAndKwargs.capture(*args, **kwargs), random_streams=...)`;
  `random_streams` maps stream names to JAX keys or `fl.RandomStream`s (a single key is
  taken as Flax takes `rngs=key`). Every other keyword is a side input passed to
  replacement layers.

  Attributes:
    module: the unbound Flax module.
    method_name: the method called (a string, or the function given as `method=`).
    path: the module's scope path in the converted model.
    scope_data: the module's own variables.
    submodule_calls: `{(call_index, "Child.method"): layer}` in call order.
    capture_intermediates: Flax's `capture_intermediates` option for this apply.
    mutable: the collections the apply treats as mutable (besides those holding
      state variables), from the `mutable=` given at conversion.
    lifted_by: the lifted transforms (`"scan"`, `"vmap"`, ...) the call runs inside.
    sliced: whether one of them slices the call's variables per iteration (any but
      `jit`, `remat`/`checkpoint` and `named_call`); a sliced call runs only as part of
      its tree.
    converted_module: the module as conversion recorded it. Settings in which `module`
      differs from it (`module.clone(dtype=jnp.bfloat16)`) apply when the tree runs.
    call_specs: what conversion saw of each submodule call (arguments and output,
      abstractly); replacement outputs are checked against it.
    own_spec: what conversion saw of this call itself (None for a node conversion did
      not make); a failing call names the shapes it had then.
    origin: the id of the conversion that made the node; a replacement continues a
      call natively only through a node of the same conversion.
    frozen_levels: where the converted variables were `FrozenDict`s (`()` the whole
      dict, `(collection, *path)` below), so that `export()` has their structure.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.Dropout(0.5, deterministic=False)])
    >>> x, rngs = jnp.ones((1, 3)), {"dropout": jax.random.key(1)}
    >>> variables = model.init(jax.random.key(0), x)
    >>> tree = fl.unflaxify(model, variables, x, rngs=rngs)
    >>> out = tree(fl.ArgsAndKwargs.capture(x), random_streams=rngs)
    >>> bool((out == model.apply(variables, x, rngs=rngs)).all())
    True
  """

  module: Any = static_field()
  method_name: Any = static_field()
  path: Path = static_field()
  scope_data: InterceptedFlaxScopeData
  submodule_calls: dict[tuple[int, str], Any]
  capture_intermediates: Any = static_field(default=False)
  mutable: tuple[str, ...] = static_field(default=())
  lifted_by: tuple[str, ...] = static_field(default=())
  sliced: bool = static_field(default=False)
  converted_module: Any = static_field(default=None)
  call_specs: tuple[CallSpec, ...] = static_field(default=())
  own_spec: CallSpec | None = static_field(default=None)
  origin: int = static_field(default=0)
  frozen_levels: tuple[Path, ...] = static_field(default=())
  treescope_hidden_fields = (
    "converted_module",
    "call_specs",
    "own_spec",
    "origin",
    "frozen_levels",
  )
  treescope_short_fields = ("module",)

  @property
  def module_type(self) -> type:
    """The class of the Linen module whose method this node calls."""
    return type(self.module)

  def settings(self) -> dict[str, Any]:
    """The Linen module's dataclass fields (`parent` and `name` left out)."""
    return {
      f.name: getattr(self.module, f.name)
      for f in dataclasses.fields(self.module)
      if f.name not in ("parent", "name")
    }

  def export(self) -> dict[str, Any]:
    """The variables of this call's module as a Flax variables dict, edits included.

    `node.module.apply(node.export(), ...)` runs the module natively with the tree's
    current parameters and state (variables not created yet are left out). The dicts
    are new; the leaves are the tree's own: the same arrays (so shardings are kept),
    boxed as they were given (`nn.Partitioned`, `nn.LogicallyPartitioned`); NumPy
    arrays are copies. The dicts are `FrozenDict`s where the converted variables were
    (below this call's module path for a call inside the tree). Nothing is written into
    the variables the tree was converted from.

    Raises:
      ExportError: if a call under this one was replaced or wrapped by a layer (the
        message lists them), or a submodule's settings were edited
        (`module.clone(dtype=...)`): a variables dict can express neither.

    Example:
      >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
      >>> model, x = nn.Dense(2), jnp.ones((1, 3))
      >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
      >>> tree.scope_data.parameters["bias"].value += 1.0
      >>> tree.export()["params"]["bias"]
      Array([1., 1.], dtype=float32)
    """
    return adapter_of(self).export(self)

  def _run_root(
    self, argument: ArgsAndKwargs, /, random_streams: Any = None, **side_inputs: Any
  ) -> Any:
    return run_tree(self, argument, random_streams, side_inputs)
