"""`NNXAdapter`: how the runtime converts, runs and isolates NNX calls.

An NNX variable's key is its attribute path from the root of the run. A run rebuilds a
private copy of the root's module from its `GraphDef` and the gathered values, marks
its modules for the `NNXInterceptor`, calls the method and reads the copy's state back.
An isolated execution is rebuilt from the module's `GraphDef` and variable values at the
start of the call (NNX keeps random state in variables, so no rng state is needed).
Flax internals used: through `flaxlens._compat` (`nnx_graph`, `nnx_variables`, `tracing`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from flaxlens._compat import nnx_attention, nnx_graph, nnx_variables, tracing
from flaxlens.core._adapter import FrameworkAdapter, register_adapter
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._cache import Derived
from flaxlens.core._export import check_exportable
from flaxlens.core._names import join_name
from flaxlens.core._recorder import Execution, standalone
from flaxlens.core._runtime import Gathered, private_value
from flaxlens.core._variables import Uninitialized
from flaxlens.core._walk import pristine_tree
from flaxlens.errors import ExportError, FlaxlensError, UnsupportedFlaxFeatureError
from flaxlens.nnx._convert import label_of, unflaxify_nnx
from flaxlens.nnx._definition import (
  PrivateCopy,
  apply_static_edits,
  equal,
  navigate,
  own_containers,
  plain_module,
  split_leaves,
  static_edits,
)
from flaxlens.nnx._interceptor import NNXInterceptor, call_method
from flaxlens.nnx._node import InterceptedNNXModuleMethod

Path = tuple[Any, ...]


class NNXAdapter(FrameworkAdapter):
  """Flax NNX (`flax.nnx.Module`) behind the runtime's `FrameworkAdapter` interface."""

  name = "nnx"
  node_type = InterceptedNNXModuleMethod

  def attention_class(self, module_type: type) -> type | None:
    attention = nnx.MultiHeadAttention
    return attention if issubclass(module_type, attention) else None

  def declares_trailing_features(self, module_type: type) -> bool:
    return issubclass(module_type, nnx.LinearGeneral)

  def is_own_attention_function(self, fn: Any) -> bool:
    return fn is nnx.dot_product_attention

  def attention_weights(
    self, settings: dict[str, Any], query: Any, key: Any, given: dict[str, Any]
  ) -> Any:
    return nnx_attention.dot_product_attention_weights(
      query,
      key,
      mask=given.get("mask"),
      dtype=settings.get("dtype"),
      precision=settings.get("precision"),
      is_causal=bool(given.get("is_causal", False)),
    )

  def accepts(self, model: Any) -> bool:
    return isinstance(model, nnx.Module)

  def convert(self, model: Any, *args: Any, **kwargs: Any) -> InterceptedNNXModuleMethod:
    return unflaxify_nnx(model, *args, **kwargs)

  def entries(self, node: Any, base: tuple[Any, ...]) -> Iterator[tuple[Any, Any, Any]]:
    data = node.scope_data
    for spec in node.specs:
      group = data.parameters if spec.collection is None else data.variables.get(spec.collection)
      entry = (group or {}).get(spec.name, _ABSENT)
      if entry is _ABSENT:
        raise FlaxlensError(
          f"{node.where()}: the node has no entry {spec.name!r} any more. Edit a"
          " variable's .value instead of removing it from its scope_data."
        )
      yield base + spec.path, entry, spec

  def key_name(self, key: Any) -> str:
    return repr(join_name(key))

  def new_interceptor(self, root: Any, side_inputs: dict[str, Any]) -> NNXInterceptor:
    return NNXInterceptor(side_inputs=side_inputs, building=False)

  def native_run(
    self, root: Any, gathered: Gathered, random_streams: Any, interceptor: Any
  ) -> Callable[[ArgsAndKwargs], tuple[Any, dict[Any, Any]]]:
    copy = _idle_copies(root).take()
    if copy is None:
      copy = _rebuild(root, gathered)
    else:
      copy.refill(gathered.values)
    interceptor.mark(copy.sites(root.path), copy.classes)
    copy.seal()

    def run(argument: ArgsAndKwargs) -> tuple[Any, dict[Any, Any]]:
      output = call_method(copy.model, root.method_name, argument.args, argument.kwargs)
      state = copy.state()
      if _may_keep(copy, root, interceptor, output):
        copy.empty()
        _idle_copies(root).keep(copy)
      return output, state

    return run

  def record_before(
    self, interceptor: Any, node: Any, module: Any, args: Any, kwargs: Any
  ) -> tuple[Any, Any]:
    _refuse_graph_arguments(node, (args, kwargs))
    graphdef, before = split_leaves(module)
    return (graphdef, node.method_name), before

  def record_after(self, node: Any, module: Any, output: Any) -> tuple[Any, Any]:
    return split_leaves(module)

  def check_isolatable(self, node: Any) -> None:
    return None  # A call that receives NNX objects is refused as it is recorded.

  def isolated_call(self, execution: Execution) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    graphdef, method = execution.static_before
    argument = execution.argument
    module = plain_module(graphdef, execution.before)
    submodel, state = standalone(
      unflaxify_nnx(module, *argument.args, method=method, **argument.kwargs)
    )
    after = plain_module(execution.static_after, execution.after)
    variables = nnx.to_flat_state(nnx.state(after))
    final = {label_of(tuple(p), v): nnx_variables.raw_value(v) for p, v in variables}
    return submodel, state, final

  def describe(self, submodel: Any, encode: Callable[[Any, str], Any]) -> dict[str, Any]:
    values = Gathered(submodel).values
    definition = submodel.definition
    return {
      "graphdef": encode(definition.graphdef, "graphdef"),
      "leaves": encode([values[p] for p in definition.leaf_paths], "variables"),
      "method": encode(submodel.method_name, "method"),
    }

  def rebuild(
    self,
    recipe: dict[str, Any],
    decode: Callable[[Any, str], Any],
    argument: ArgsAndKwargs,
    side_inputs: dict[str, Any],
  ) -> tuple[Any, tuple[Any, ...]]:
    graphdef = decode(recipe["graphdef"], "recipe.graphdef")
    if not isinstance(graphdef, nnx.GraphDef):
      raise TypeError("the recipe's graphdef is not an NNX GraphDef")
    module = nnx.merge(graphdef, list(decode(recipe["leaves"], "recipe.leaves")))
    if not isinstance(module, nnx.Module):
      raise TypeError("the recipe does not describe an nnx.Module")
    method = decode(recipe["method"], "recipe.method")
    return standalone(unflaxify_nnx(module, *argument.args, method=method, **argument.kwargs))

  def accepts_native(self, model: Any) -> bool:
    return isinstance(model, nnx.Module)

  def run_native(
    self, model: Any, argument: ArgsAndKwargs, method: Any, rngs: Any, mutable: Any
  ) -> tuple[Any, dict[str, Any]]:
    graphdef, state = nnx.split(model)  # A copy: new Variables, the same JAX arrays.
    copy = nnx.merge(graphdef, jax.tree_util.tree_map(private_value, state))
    method = "__call__" if method is None else method
    output = call_method(copy, method, argument.args, argument.kwargs)
    state = nnx.to_flat_state(nnx.state(copy))
    return output, {label_of(tuple(p), v): nnx_variables.raw_value(v) for p, v in state}

  def native_call_fix(self, error: Exception) -> str:
    return "Check that the module itself runs on these arguments: model(*args, **kwargs)."

  def export(self, node: Any, into: nnx.Module | None = None) -> nnx.Module:
    node.check_runs_alone("be exported on its own; export the tree it belongs to")
    check_exportable(node)
    model = _rebuild(node, Gathered(node)).model
    own_containers(model)  # Static lists and dicts are the tree's definition's own.
    if into is None:
      return model
    _update_in_place(node, into, model)
    return into

  def exported_variables(self, exported: Any) -> Any:
    return nnx.state(exported) if isinstance(exported, nnx.Module) else None

  def with_exported_variables(self, like: Any, variables: Any) -> Any:
    return nnx.merge(nnx.graphdef(like), variables)


def _update_in_place(node: Any, into: Any, model: Any) -> None:
  """Sets `into`'s variables and static attributes to `model`'s, checking they fit first.

  `into` keeps its `Variable` objects (an optimizer holding them sees the new values);
  variables the converted call created are added, as the call adds them.
  """
  where = node.where()
  if type(into) is not node.module_type:
    raise ExportError(
      f"{where}: export(into=...) needs a {node.module_type.__name__} to update, got a"
      f" {type(into).__name__}. Pass the model the tree was converted from (or one of"
      " the same architecture)."
    )
  have = dict(nnx.to_flat_state(nnx.state(into)))
  want = dict(nnx.to_flat_state(nnx.state(model)))
  created = {spec.path for spec in node.specs if spec.created}
  differ = sorted(
    [join_name(p) for p in have if p not in want]
    + [join_name(p) for p in want if p not in have and p not in created]
    + [join_name(p) for p in have.keys() & want.keys() if not _same_kind(have[p], want[p])]
  )
  if differ:
    raise ExportError(
      f"{where}: the model given to export(into=...) does not fit the tree: its variables"
      f" {differ[:6]} are missing, extra, or of another type, shape or dtype. Pass the"
      " model the tree was converted from, or call export() for a new model."
    )
  nnx.update(into, nnx.state(model))
  for path, module in nnx_graph.iter_modules(model):
    target = navigate(into, tuple(path))
    current = nnx_graph.static_attributes(target)
    for name, value in nnx_graph.static_attributes(module).items():
      if name not in current or not equal(current[name], value):
        nnx_graph.set_static(target, name, value)


def _same_kind(a: nnx.Variable, b: nnx.Variable) -> bool:
  x, y = nnx_variables.raw_value(a), nnx_variables.raw_value(b)
  return (
    type(a) is type(b)
    and getattr(x, "shape", None) == getattr(y, "shape", None)
    and getattr(x, "dtype", None) == getattr(y, "dtype", None)
  )


_ABSENT = object()


def _rebuild(root: Any, gathered: Gathered) -> PrivateCopy:
  """The root's module rebuilt from the gathered values (see `NNXModuleDef.rebuild`)."""
  values, created = {}, {}
  for path, value in gathered.values.items():
    spec = gathered.info[path]
    if not spec.created:
      values[path] = value
    elif not isinstance(value, Uninitialized):
      created[path] = spec.type.from_metadata(private_value(value), dict(spec.metadata))
  copy = root.definition.rebuild(values, created)
  apply_static_edits(copy.model, static_edits(root))
  return copy


class _IdleCopies:
  """The private copy a root node keeps between eager calls, handed out to one run at a time.

  Rebuilding the copy (`nnx.merge`) is most of what an eager NNX call adds to the
  model's own call. A run that ends with its copy intact (`_may_keep`) leaves the copy
  here, emptied; the next eager run of the same node takes it (so two threads, or a
  call of the tree inside one of its own replacement layers, never share one) and
  refills it with the tree's values of that call. Copying, deep-copying or pickling a
  node starts the copy afresh.
  """

  __slots__ = ("_copies",)

  def __init__(self) -> None:
    self._copies: list[PrivateCopy] = []

  def take(self) -> PrivateCopy | None:
    """An idle copy, only outside any JAX trace (the copy's variables were made there)."""
    if not self._copies or not tracing.at_top_level():
      return None
    try:
      return self._copies.pop()  # Atomic: two threads never get the same copy.
    except IndexError:
      return None

  def keep(self, copy: PrivateCopy) -> None:
    if not self._copies:
      self._copies.append(copy)


# The root node's own pool (a resource no copy of the node shares: `core/_cache.py`).
_idle_copies = Derived("idle_copies", lambda root: _IdleCopies())


def _may_keep(copy: PrivateCopy, root: Any, interceptor: Any, output: Any) -> bool:
  """Whether `copy` can serve the next eager call of `root` after this run.

  Only a plain run (no capture, intervention or isolation recording) of a tree whose
  calls are all its own (`pristine`: no replacement layer saw the copy's modules),
  whose output holds none of the copy's NNX objects, and whose copy came out intact.
  """
  if interceptor.probing is not None or interceptor.recorder is not None:
    return False
  if not copy.intact() or not pristine_tree(root):
    return False
  leaves = jax.tree_util.tree_leaves(output, is_leaf=_is_graph_object)
  return not any(map(_is_graph_object, leaves))


def _is_graph_object(x: Any) -> bool:
  return isinstance(x, nnx.Pytree | nnx.Variable)


def _refuse_graph_arguments(node: Any, arguments: Any) -> None:
  leaves = jax.tree_util.tree_leaves(arguments, is_leaf=lambda x: isinstance(x, nnx.Pytree))
  if any(isinstance(x, nnx.Pytree | nnx.Variable) for x in leaves):
    raise UnsupportedFlaxFeatureError(
      f"{node.where()}: the call receives NNX objects (modules, Rngs or variables) as"
      " arguments, which isolating does not support yet. Isolate the call that owns them."
    )


NNX = register_adapter(NNXAdapter())
