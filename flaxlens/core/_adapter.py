"""`FrameworkAdapter`: what a Flax API supplies so that the framework-neutral runtime runs it.

The runtime in `core` converts, runs, isolates and saves calls without knowing which Flax
API made them. What does know lives behind one adapter per API (`flaxlens.linen`,
`flaxlens.nnx`), registered for the node type its conversion makes; the runtime and the
tools find it with `adapter_of(node)` and never ask which framework a node comes from.
No Flax internals here.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from typing import Any

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._calls import CallInterceptor
from flaxlens.core._node import CallNode
from flaxlens.errors import ArgumentError


class FrameworkAdapter(abc.ABC):
  """The operations the runtime needs from one Flax API.

  A variable is addressed by a *key* the adapter chooses (Linen: `(collection, path)`,
  NNX: the attribute path), relative to the root of a run; the runtime gathers the
  tree's entries by key, hands them to `native_run`, and writes back the values the run
  returns by key. See docs/architecture.md for the data flow.

  Attributes:
    name: the API's name in artifacts and messages (`"linen"`, `"nnx"`).
    node_type: the `CallNode` subclass its conversion makes.
  """

  name: str
  node_type: type[CallNode]

  # --- converting -----------------------------------------------------------------------

  @abc.abstractmethod
  def accepts(self, model: Any) -> bool:
    """Whether `model` is a module of this API."""

  @abc.abstractmethod
  def convert(self, model: Any, *args: Any, **kwargs: Any) -> CallNode:
    """Records the calls of `model` on the example arguments and builds their nodes."""

  # --- running --------------------------------------------------------------------------

  @abc.abstractmethod
  def entries(self, node: CallNode, base: tuple[Any, ...]) -> Iterator[tuple[Any, Any, Any]]:
    """`(key, entry, info)` for each variable `node` holds, its module at `base`.

    `entry` is a variable, a frozen value, a slot or a plain value; `info` is whatever
    the adapter needs to rebuild the variable (None if nothing).
    """

  @abc.abstractmethod
  def key_name(self, key: Any) -> str:
    """How a variable's key reads in messages (`"params:Dense_0/kernel"`)."""

  @abc.abstractmethod
  def new_interceptor(self, root: CallNode, side_inputs: dict[str, Any]) -> CallInterceptor:
    """The interceptor receiving the calls of one run of `root`."""

  @abc.abstractmethod
  def native_run(
    self, root: CallNode, gathered: Any, random_streams: Any, interceptor: CallInterceptor
  ) -> Callable[[ArgsAndKwargs], tuple[Any, dict[Any, Any]]]:
    """Prepares a native run of `root` on the `gathered` variables.

    Returns a function that, called while `interceptor` is active, runs the root's
    module natively and returns `(output, updates)`: the variables' values after the
    call, by key (variables the run makes up for replaced calls left out).
    """

  # --- isolating ------------------------------------------------------------------------

  @abc.abstractmethod
  def record_before(
    self, interceptor: CallInterceptor, node: CallNode, module: Any, args: Any, kwargs: Any
  ) -> tuple[Any, Any]:
    """`(static, arrays)`: what an execution of `node` starts from (variables, rng state).

    `arrays` may hold tracers; they reach `isolated_call` as concrete values.
    """

  @abc.abstractmethod
  def record_after(self, node: CallNode, module: Any, output: Any) -> tuple[Any, Any]:
    """`(static, arrays)`: what the execution of `node` left in its module."""

  @abc.abstractmethod
  def check_isolatable(self, node: CallNode) -> None:
    """Raises `UnsupportedFlaxFeatureError` if an execution of `node` cannot stand alone."""

  @abc.abstractmethod
  def isolated_call(self, execution: Any) -> tuple[CallNode, tuple[Any, ...], dict[str, Any]]:
    """`(submodel, initial state, final values by label)` of one recorded `Execution`.

    The submodel is the call converted on its own from what it started from, with its
    parameters frozen in and its state variables unbound (see `standalone`).
    """

  # --- artifacts ------------------------------------------------------------------------

  @abc.abstractmethod
  def describe(self, submodel: CallNode, encode: Callable[[Any, str], Any]) -> dict[str, Any]:
    """The recipe of a bound standalone submodel: its module and variables, encoded."""

  @abc.abstractmethod
  def rebuild(
    self,
    recipe: dict[str, Any],
    decode: Callable[[Any, str], Any],
    argument: ArgsAndKwargs,
    side_inputs: dict[str, Any],
  ) -> tuple[CallNode, tuple[Any, ...]]:
    """The standalone submodel `describe` described, and its initial state.

    Raises:
      TypeError: if the recipe describes something else than a module of this API.
    """

  # --- exporting ------------------------------------------------------------------------

  @abc.abstractmethod
  def export(self, node: CallNode) -> Any:
    """The call's module in the framework's own form, with the tree's current values."""

  @abc.abstractmethod
  def exported_variables(self, exported: Any) -> Any:
    """The variables of an exported model as one pytree (None if it is not one of this API).

    Linen: the variables dict itself; NNX: the module's `nnx.State`.
    """

  @abc.abstractmethod
  def with_exported_variables(self, like: Any, variables: Any) -> Any:
    """A new exported model shaped as `like`, holding `variables` (as above); `like` unchanged."""

  # --- attention (fl.heads, fl.attention_pattern) ----------------------------------------

  @abc.abstractmethod
  def attention_class(self, module_type: type) -> type | None:
    """The API's multi-head attention class that `module_type` is or subclasses (Linen:
    `nn.MultiHeadDotProductAttention`), or None: such a module's heads are the input of
    its `out` projection, and its weights are what `attention_weights` computes."""

  @abc.abstractmethod
  def declares_trailing_features(self, module_type: type) -> bool:
    """Whether calls of `module_type` declare their trailing axes as features, in their
    `features`/`out_features` (output) and `axis` (input) settings (Linen:
    `nn.DenseGeneral`)."""

  @abc.abstractmethod
  def is_own_attention_function(self, fn: Any) -> bool:
    """Whether `fn` (an attention module's `attention_fn`) is the API's own
    `dot_product_attention`, whose weights `attention_weights` computes."""

  @abc.abstractmethod
  def attention_weights(
    self, settings: dict[str, Any], query: Any, key: Any, given: dict[str, Any]
  ) -> Any:
    """The softmax weights `(batch..., heads, q, k)` the API's attention computes from
    `query` and `key`, with the module's `settings` (`dtype`, `precision`, ...) and the
    arguments its call was `given`, by name (`mask`; NNX: `is_causal`)."""

  # --- plain models ---------------------------------------------------------------------

  def native_call_fix(self, error: Exception) -> str:
    """How to fix a plain model's run (`run_native`) that raised `error` in its own code."""
    return "Check that the model itself runs on these arguments."


_adapters: list[FrameworkAdapter] = []


def register_adapter(adapter: FrameworkAdapter) -> FrameworkAdapter:
  """Makes `adapter` the one for its `node_type` and its `name`."""
  _adapters.append(adapter)
  return adapter


def adapter_of(node: CallNode) -> FrameworkAdapter:
  """The adapter of the API that made `node`.

  Raises:
    ArgumentError: for a node no adapter made (a hand-built `CallNode` subclass).
  """
  for adapter in _adapters:
    if isinstance(node, adapter.node_type):
      return adapter
  raise ArgumentError(
    f"{node.where()}: a {type(node).__name__} was not made by fl.unflaxify, so flaxlens"
    " cannot run it natively. Convert the model with fl.unflaxify."
  )


def registered_adapters() -> tuple[FrameworkAdapter, ...]:
  """The adapters of the Flax APIs, in the order they were registered."""
  return tuple(_adapters)


def adapter_for_model(model: Any) -> FrameworkAdapter | None:
  """The adapter whose `run_native` takes `model`, or None."""
  return next((a for a in _adapters if a.accepts_native(model)), None)


def adapter_for_exported(exported: Any) -> FrameworkAdapter | None:
  """The adapter whose `export` makes models such as `exported`, or None."""
  return next((a for a in _adapters if a.exported_variables(exported) is not None), None)


def adapter_named(name: str) -> FrameworkAdapter | None:
  """The adapter called `name` (`"linen"`, `"nnx"`), or None."""
  return next((a for a in _adapters if a.name == name), None)
