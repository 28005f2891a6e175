"""The NNX call node: `InterceptedNNXModuleMethod`, one per intercepted method call.

Calling a node rebuilds a private copy of its module with `nnx.merge` (its `GraphDef`
plus the tree's current variable values, `_definition`), instruments the copy's classes
so that its calls report to an `NNXInterceptor` (`_interceptor`), and runs the method
natively through the framework-neutral runtime (`core._runtime`) and the NNX adapter
(`_adapter`): an unmodified child node lets its call continue (so rng streams, batch
statistics, caches and NNX transforms are NNX's own, bit for bit) and any other layer
replaces the call. The copy's updated state is written back into the tree's
`StateVariable`s and the copy is dropped; the user's model is never touched. No Flax
internals here.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Self

from flax import nnx

from flaxlens.core._adapter import adapter_of
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._call_variables import InterceptedFlaxScopeData
from flaxlens.core._names import Path
from flaxlens.core._node import CallNode
from flaxlens.core._runtime import run_tree
from flaxlens.core._spec import CallSpec
from flaxlens.core._struct import static_field
from flaxlens.errors import FlaxlensError
from flaxlens.nnx import _arguments  # noqa: F401  (registers NNX variables with variable_jit)
from flaxlens.nnx._definition import NNXModuleDef
from flaxlens.nnx._modes import restatic


class NNXVariableSpec(NamedTuple):
  """What a node knows about one of its NNX variables, to rebuild it exactly.

  Attributes:
    name: its name in the node's `scope_data` (`"rngs/default/count"`).
    collection: None for a parameter (in `scope_data.parameters`), else its collection
      in `scope_data.variables` (see `InterceptedFlaxScopeData`).
    path: its path from the node's module, as NNX spells it (`("rngs", "count")`).
    type: the `nnx.Variable` subclass (`nnx.Param`, `nnx.BatchStat`, ...).
    metadata: the variable's metadata, as `(name, value)` pairs.
    created: whether the converted call itself created it (a `sow` outside
      `nnx.capture`, a cache made by `init_cache`); such variables are not part of the
      node's `GraphDef` and are added to the private copy once they hold a value.
  """

  name: str
  collection: str | None
  path: Path
  type: type
  metadata: tuple[tuple[str, Any], ...]
  created: bool = False


class InterceptedNNXModuleMethod(CallNode):
  """One call of a Flax NNX module method, with its submodule calls as children.

  Call it as `node(fl.ArgsAndKwargs.capture(*args, **kwargs), **side_inputs)`; side
  inputs are passed to replacement layers. NNX keeps random state in the model, so
  dropout masks follow the tree's `RngKey`/`RngCount` state variables.

  Attributes:
    module_type: the module's class (the user's class, not an instrumented one).
    method_name: the method called (a string, or the function given as `method=`).
    path: the module's path in the converted model (`("blocks", 0, "linear")`).
    scope_data: the module's own variables, as for Linen: `parameters` (its
      `nnx.Param`s as `Parameter`s, by relative name; a variable of a submodule that
      makes no call of its own is held by its nearest calling ancestor,
      `"linear/kernel"`) and `variables` (its other NNX variables as `StateVariable`s,
      `{collection: {name: StateVariable}}`, collections named as NNX names them:
      see `InterceptedFlaxScopeData`).
    submodule_calls: `{(call_index, "child.method"): layer}` in call order.
    definition: the module's static definition (its `nnx.GraphDef`); with the
      variables it rebuilds the module.
    specs: one `NNXVariableSpec` per variable in `scope_data`.
    sliced: whether the call runs inside an NNX transform that slices its variables
      (`nnx.scan`, `nnx.vmap`); such a node runs only as part of its tree.
    call_specs: what conversion saw of each submodule call (arguments and output,
      abstractly); replacement outputs are checked against it.
    own_spec: what conversion saw of this call itself (None for a node conversion did
      not make); a failing call names the shapes it had then.
    origin: the id of the conversion that made the node; a replacement continues a
      call natively only through a node of the same conversion.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> from flax import nnx
    >>> model, x = nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, x)
    >>> bool((tree(fl.ArgsAndKwargs.capture(x)) == model(x)).all())
    True
  """

  module_type: type = static_field()
  method_name: Any = static_field()
  path: Path = static_field()
  scope_data: InterceptedFlaxScopeData
  submodule_calls: dict[tuple[int, str], Any]
  definition: NNXModuleDef = static_field()
  specs: tuple[NNXVariableSpec, ...] = static_field(default=())
  sliced: bool = static_field(default=False)
  call_specs: tuple[CallSpec, ...] = static_field(default=())
  own_spec: CallSpec | None = static_field(default=None)
  origin: int = static_field(default=0)
  treescope_hidden_fields = ("specs", "call_specs", "own_spec", "origin")
  treescope_short_fields = ("module_type", "definition")

  def _run_root(
    self, argument: ArgsAndKwargs, /, random_streams: Any = None, **side_inputs: Any
  ) -> Any:
    if random_streams is not None:
      raise FlaxlensError(
        f"{self.where()}: random_streams is for Linen trees. An NNX model keeps its"
        " random state in the model (its RngKey/RngCount variables are state variables"
        " of this tree); pass an nnx.Rngs as a call argument if the method takes one."
      )
    return run_tree(self, argument, None, side_inputs)

  def settings(self) -> dict[str, Any]:
    """The NNX module's static attributes, as its `GraphDef` records them."""
    return dict(self.definition.statics().get((), {}))

  def export(self, into: nnx.Module | None = None) -> nnx.Module:
    """This call's module as plain NNX with the tree's current variables, edits included.

    Without `into`, a new module: plain NNX (no flaxlens classes), holding variables of
    the types and metadata (sharding names included) the converted model had and the
    tree's arrays (the same arrays, so shardings are kept); it shares nothing with the
    tree or the converted model but those immutable arrays. With `into`, that module
    (the converted model, or one of the same architecture) is updated in place instead
    and returned: its `Variable` objects are kept and get the tree's values, and static
    attributes the tree changed (`tree.eval()`) are set on it. Nothing else is ever
    modified. Variables the converted call created are included once they hold a value.

    Raises:
      ExportError: if a call under this one was replaced or wrapped by a layer (the
        message lists them), or `into` does not have this module's class and variables.
      UnsupportedFlaxFeatureError: if the call runs inside `nnx.scan`/`nnx.vmap`.

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp
      >>> from flax import nnx
      >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
      >>> tree = fl.unflaxify(model, jnp.ones((1, 3)))
      >>> tree.scope_data.parameters["bias"].value += 1.0
      >>> tree.export().bias[...], model.bias[...]
      (Array([1., 1.], dtype=float32), Array([0., 0.], dtype=float32))
      >>> tree.export(into=model) is model, model.bias[...]
      (True, Array([1., 1.], dtype=float32))
    """
    return adapter_of(self).export(self, into=into)

  def set_attributes(
    self, *filters: Any, raise_if_not_found: bool = True, **attributes: Any
  ) -> Self:
    """A copy of this tree whose calls run as after NNX's `module.set_attributes(...)`.

    The tree is immutable: the change is made by NNX on a copy of the module and
    recorded in the nodes' `GraphDef`s.

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
      ...                        nnx.Dropout(0.5, rngs=nnx.Rngs(1)))
      >>> x = jnp.ones((1, 2))
      >>> tree = fl.unflaxify(model, x).set_attributes(deterministic=True)
      >>> bool((tree(fl.ArgsAndKwargs.capture(x)) == model.layers[0](x)).all())
      True
    """
    return restatic(
      self,
      lambda m: m.set_attributes(*filters, raise_if_not_found=raise_if_not_found, **attributes),
    )

  def train(self, **attributes: Any) -> Self:
    """A copy of this tree in training mode, as NNX's `module.train(**attributes)`.

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp
      >>> from flax import nnx
      >>> model = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
      >>> model.eval()
      >>> x = jnp.ones((4,))
      >>> tree = fl.unflaxify(model, x)
      >>> model.train()
      >>> expected = model(x)
      >>> bool((tree.train()(fl.ArgsAndKwargs.capture(x)) == expected).all())
      True
    """
    return restatic(self, lambda m: m.train(**attributes))

  def eval(self, **attributes: Any) -> Self:
    """A copy of this tree in evaluation mode, as NNX's `module.eval(**attributes)`.

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp
      >>> from flax import nnx
      >>> model = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((4,))
      >>> tree = fl.unflaxify(model, x).eval()
      >>> tree(fl.ArgsAndKwargs.capture(x))
      Array([1., 1., 1., 1.], dtype=float32)
    """
    return restatic(self, lambda m: m.eval(**attributes))

  def view(self, *, only: Any = ..., raise_if_not_found: bool = True, **kwargs: Any) -> Self:
    """A copy of this tree whose calls run as those of `nnx.view(module, **kwargs)`.

    Example:
      >>> import flaxlens as fl, jax.numpy as jnp
      >>> from flax import nnx
      >>> model = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((4,))
      >>> tree = fl.unflaxify(model, x).view(deterministic=True)
      >>> tree(fl.ArgsAndKwargs.capture(x))
      Array([1., 1., 1., 1.], dtype=float32)
    """
    return restatic(
      self,
      lambda m: nnx.view(m, only=only, raise_if_not_found=raise_if_not_found, **kwargs),
    )
