"""`CallNode`, the base class of converted calls.

A node stands for one call a Flax module made; its `submodule_calls` hold the calls made
inside it, each a node or a replacement layer. Nodes of one conversion share an
`origin`; which calls a run of a root makes through them is `core/_walk.py: calls`.
No Flax internals here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import jax

from flaxlens.core._active import current_interceptor
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._cache import Derived
from flaxlens.core._checks import refuse
from flaxlens.core._layer import Layer
from flaxlens.core._names import CallKey
from flaxlens.core._spec import CallSpec
from flaxlens.errors import ArgumentError, UnsupportedFlaxFeatureError


class CallNode(Layer):
  """Base class of converted calls: one node per call a Flax module made.

  A node is called as `node(fl.ArgsAndKwargs.capture(*args, **kwargs), **side_inputs)`
  and runs its call natively; `submodule_calls` holds the calls made inside it, each a
  node or a replacement layer. Every node, Linen or NNX, has these fields:

  Attributes:
    module_type: the class of the Flax module whose method the node calls.
    method_name: the method called (a string, or the function given as `method=`).
    path: the module's path in the converted model.
    scope_data: the module's own variables (an `InterceptedFlaxScopeData`).
    submodule_calls: `{(call_index, "Child.method"): layer}` in call order.
    sliced: whether the call runs inside a lifted transform that slices its variables
      per iteration (`nn.scan`, `nn.vmap`, `nnx.scan`, `nnx.vmap`); such a call runs
      only as part of its tree.
    call_specs: what conversion saw of each submodule call (one `CallSpec` each).
    own_spec: what conversion saw of this call itself (None for a hand-built node).
    origin: an id shared by the nodes of one conversion.

  Each node type also has `export()`, the call's module in its framework's own form with
  the tree's current values (Linen: the variables dict for `module.apply`; NNX: a new
  model), and `where()`, how messages name the call.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> isinstance(tree, fl.CallNode), tree.module_type.__name__, tree.where()
    (True, 'Dense', 'Dense.__call__')
  """

  # The calls a call makes are drawn one per line, never run together on one line.
  treescope_expanded_fields = ("submodule_calls",)

  def readable_path(self) -> tuple[str, str]:
    """`("Block_0/Dense_0", "__call__")`: the module path and the method name."""
    name = self.method_name
    if not isinstance(name, str):
      name = getattr(name, "__name__", type(name).__name__)
    return "/".join(str(p) for p in self.path), name

  def where(self) -> str:
    """`"Block_0/Dense_0.__call__"`: how messages name this call."""
    path, method = self.readable_path()
    return f"{path or self.module_type.__name__}.{method}"

  def settings(self) -> dict[str, Any]:
    """The settings of the call's module, by name: a Linen module's dataclass fields, an
    NNX module's static attributes (`{"num_heads": 8, ...}`); empty for a hand-built
    node. Read-only: edit a Linen module's settings with `module.clone(...)`, an NNX
    tree's with `set_attributes`."""
    return {}

  def check_runs_alone(self, cannot: str) -> None:
    """Refuses an operation a sliced call cannot do; `cannot` completes the message."""
    if self.sliced:
      raise UnsupportedFlaxFeatureError(
        f"{self.where()}: this call runs inside a lifted transform that slices its"
        f" variables per iteration (nn.scan, nn.vmap, nnx.scan, nnx.vmap), so it cannot"
        f" {cannot}."
      )

  def __call__(self, argument: ArgsAndKwargs, /, **side_inputs: Any) -> Any:
    if not isinstance(argument, ArgsAndKwargs):
      raise ArgumentError(
        f"{self.where()}: a converted call takes fl.ArgsAndKwargs.capture(*args,"
        f" **kwargs) as its argument, got {type(argument).__name__}."
      )
    interceptor = current_interceptor()
    if interceptor is not None and interceptor.pending and interceptor.pending[-1].matches(self):
      return interceptor.continue_pending(self, argument)
    return self._run_root(argument, **side_inputs)

  def _run_root(self, argument: ArgsAndKwargs, /, **side_inputs: Any) -> Any:
    """Runs this node as the root of a run (its framework's node type implements it)."""
    raise NotImplementedError

  # `call_specs` by key (a static field: it never changes).
  _flaxlens_specs = Derived("specs", lambda self: {spec.key: spec for spec in self.call_specs})

  def call_spec(self, key: CallKey) -> CallSpec | None:
    """What conversion saw of the submodule call `key` (None if it did not see it)."""
    return self._flaxlens_specs.get(key)

  def _describe(self, key: CallKey) -> str:
    return f"{self.where()}: call {key!r}"


_origins = itertools.count(1)


def new_origin() -> int:
  """A fresh id for the nodes of one conversion (0 is left for hand-built nodes)."""
  return next(_origins)


def is_call_node(x: Any) -> bool:
  return isinstance(x, CallNode)


def check_tree(value: Any, where: str, name: str = "tree") -> CallNode:
  """`value` if it is a converted tree (a call node); else `ArgumentError` naming `where`."""
  if not isinstance(value, CallNode):
    raise refuse(
      where,
      name,
      value,
      "a converted tree",
      "Convert the model first: tree = fl.unflaxify(model, ...) (Linen: model, variables,"
      " *example_args; NNX: model, *example_args), and pass the tree.",
    )
  return value


def iter_call_nodes(tree: Any) -> Iterator[CallNode]:
  """All call nodes of `tree`, parents first, also those inside replacement layers."""
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_call_node):
    if is_call_node(leaf):
      yield leaf
      yield from iter_call_nodes(leaf.submodule_calls)
