"""Isolate one call of a converted model, with what it saw, so it can be replayed alone.

`isolate_calls` runs a copy of the whole tree once, eagerly, with a `Recorder` on the
selected call (`core._recorder`): every native execution is recorded with its arguments,
output and what its module held before and after, through `jax.debug.callback` inside
compiled bodies (once per iteration or batch member). The node's `FrameworkAdapter`
turns each execution into an `IsolatedSubmodel`: the call converted on its own,
parameters frozen in, state unbound into slots (and, for Linen, its rng state
attached), so `submodel.stateless_call(initial_var_values, saved_arg,
**saved_side_inputs)` reproduces `saved_output` and `final_var_values` bit for bit.
Framework-neutral: no Flax internals here.
"""

from __future__ import annotations

from typing import Any

import jax

from flaxlens._unflaxify import unflaxify
from flaxlens.core._adapter import FrameworkAdapter, adapter_of
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._checks import check_type
from flaxlens.core._node import CallNode, is_call_node
from flaxlens.core._recorder import Execution, Recorder, standalone
from flaxlens.core._runtime import resolve_random_streams, run_tree
from flaxlens.core._selectors import Selection, select
from flaxlens.core._variables import Uninitialized, bind_variables, unbind_variables
from flaxlens.core._walk import pristine
from flaxlens.errors import ArgumentError, FlaxlensError, UnsupportedFlaxFeatureError
from flaxlens.tools.isolation._replay import IsolatedSubmodel


def _selected_call(selection: Selection) -> tuple[CallNode, Any]:
  if not isinstance(selection, Selection):
    raise ArgumentError(
      "isolate_submodel takes a selection of one call, for example"
      f' tree.select().at_path("Block_0/Dense_0"); got {type(selection).__name__}.'
    )
  if selection.count() != 1:
    raise FlaxlensError(
      f"isolate_submodel needs a selection of exactly one call; this one selects"
      f" {selection.count()}. Narrow it (for example with .at_path or .where)."
    )
  node = selection.get()
  if not is_call_node(node):
    raise FlaxlensError(
      f"isolate_submodel needs a converted call, but the selection holds a"
      f" {type(node).__name__}. Select a call node (fl.unflaxify gives a tree of them)."
    )
  return node, selection.keypaths[0]


def isolate_calls(
  selection: Selection, argument: ArgsAndKwargs, /, **side_inputs: Any
) -> tuple[IsolatedSubmodel, ...]:
  """Isolates every execution of the selected call in one run of the whole tree.

  The tree is run once on a copy of its variables (yours are not modified). A call
  inside `nn.scan` gives one submodel per iteration, inside `nn.vmap` one per member.

  Args:
    selection: a selection of exactly one call node of a converted tree.
    argument: the arguments of the whole tree's call.
    **side_inputs: side inputs of that call, `random_streams` included.

  Returns:
    One `IsolatedSubmodel` per execution, in execution order (empty if never called).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> class Step(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, carry, _):
    ...     return nn.Dense(3)(carry), None
    >>> class Stack(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     scan = nn.scan(Step, variable_axes={"params": 0}, split_rngs={"params": True},
    ...                    length=3)
    ...     return scan()(x, None)[0]
    >>> model, x = Stack(), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> calls = fl.isolate_calls(tree.select().at_path("**/Dense_0"), fl.ArgsAndKwargs.capture(x))
    >>> [(c.call_number, c.replay().exact) for c in calls]
    [(0, True), (1, True), (2, True)]
  """
  where = "fl.isolate_calls"
  check_type(
    selection,
    Selection,
    where,
    "selection",
    "a selection of one call",
    "Select the call in the tree: tree.select().at_path('Block_0/Dense_1').",
  )
  check_type(
    argument,
    ArgsAndKwargs,
    where,
    "argument",
    "the whole tree's call arguments",
    "Pass them as a tree call takes them: fl.ArgsAndKwargs.capture(*args, **kwargs).",
  )
  node, keypath = _selected_call(selection)
  root = selection.deselect()
  if not is_call_node(root):
    raise UnsupportedFlaxFeatureError(
      f"isolate_submodel works on a tree from fl.unflaxify; the selection's root is a"
      f" {type(root).__name__}."
    )
  adapter = adapter_of(root)
  if not pristine(node):
    raise UnsupportedFlaxFeatureError(
      f"{node.where()}: calls inside it are replaced; isolate it before patching it."
    )
  adapter.check_isolatable(node)
  random_streams = resolve_random_streams(
    side_inputs.pop("random_streams", None), "isolate_submodel"
  )
  # Stateful objects among the arguments (an nnx.Rngs) advance in a run: use a copy.
  argument = jax.tree_util.tree_map(lambda x: x, argument)
  unbound, values = unbind_variables(root, freeze=True)
  copy = bind_variables(unbound, values)
  target = select(copy).at_keypaths([keypath]).get()
  if target is copy:
    return (_isolate_root(copy, argument, random_streams, side_inputs),)
  interceptor = adapter.new_interceptor(copy, side_inputs)
  interceptor.recorder = Recorder(target)
  run_tree(copy, argument, random_streams, side_inputs, interceptor=interceptor)
  jax.effects_barrier()
  return tuple(
    _isolated(adapter, execution, side_inputs, number)
    for number, execution in enumerate(interceptor.recorder.executions)
  )


def isolate_submodel(
  selection: Selection, argument: ArgsAndKwargs, /, **side_inputs: Any
) -> IsolatedSubmodel:
  """Isolates the selected call of a converted tree, with its saved inputs and results.

  Args:
    selection: a selection of exactly one call node, e.g. `tree.select().at_path(...)`.
    argument: the arguments of the whole tree's call.
    **side_inputs: side inputs of that call, `random_streams` included.

  Returns:
    The `IsolatedSubmodel`; `isolated.replay()` re-runs it and compares.

  Raises:
    FlaxlensError: if the selection is not exactly one call, or the call ran zero or
      several times (use `isolate_calls` for all of them).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.Dropout(0.5, deterministic=False)])
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> rngs = {"dropout": jax.random.key(1)}
    >>> tree = fl.unflaxify(model, variables, x, rngs=rngs)
    >>> isolated = fl.isolate_submodel(tree.select().at_path("layers_1"),
    ...                                fl.ArgsAndKwargs.capture(x), random_streams=rngs)
    >>> bool(isolated.replay())
    True
  """
  node, _ = _selected_call(selection)
  found = isolate_calls(selection, argument, **side_inputs)
  if len(found) != 1:
    raise FlaxlensError(
      f"{node.where()} ran {len(found)} times in this call"
      + (
        " (inside nn.scan or nn.vmap, or called again by a replacement); use"
        " fl.isolate_calls to get one isolated submodel per execution."
        if found
        else "; it was never called with these arguments, so there is nothing to isolate."
      )
    )
  return found[0]


def isolate(model: Any, *args: Any, at: str, **kwargs: Any) -> IsolatedSubmodel:
  """Isolates the call at path `at` of a plain Flax model, converting it first.

  Linen: `isolate(module, variables, *args, at=..., method=None, rngs=None,
  mutable=False, capture_intermediates=False, **kwargs)`. NNX: `isolate(model, *args,
  at=..., method="__call__", **kwargs)`. The model is not modified.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    >>> x = jnp.ones((1, 3))
    >>> isolated = fl.isolate(model, model.init(jax.random.key(0), x), x, at="layers_2")
    >>> isolated.saved_arg.args[0].shape
    (1, 4)
  """
  conversion = ("method", "rngs", "mutable", "capture_intermediates")
  options = {k: kwargs.pop(k) for k in conversion if k in kwargs}
  tree = unflaxify(model, *args, **options, **kwargs)
  args, side_inputs = adapter_of(tree).example_call(args, options)
  return isolate_submodel(
    tree.select().at_path(at), ArgsAndKwargs(args=args, kwargs=kwargs), **side_inputs
  )


def _isolated(
  adapter: FrameworkAdapter, execution: Execution, side_inputs: dict[str, Any], number: int
) -> IsolatedSubmodel:
  submodel, state, final_values = adapter.isolated_call(execution)
  final = tuple(
    type(v)(value=final_values.get(v.label, Uninitialized()), label=v.label) for v in state
  )
  return IsolatedSubmodel(
    submodel=submodel,
    saved_arg=execution.argument,
    saved_side_inputs=dict(side_inputs),
    saved_output=execution.output,
    initial_var_values=state,
    final_var_values=final,
    call_number=number,
    recorded_compiled=execution.compiled,
  )


def _isolate_root(
  root: CallNode,
  argument: ArgsAndKwargs,
  random_streams: Any,
  side_inputs: dict[str, Any],
) -> IsolatedSubmodel:
  submodel, state = standalone(root)
  saved_side_inputs = dict(side_inputs)
  if random_streams is not None:
    saved_side_inputs["random_streams"] = random_streams
  saved_arg = jax.tree_util.tree_map(lambda x: x, argument)  # before it advances
  output, final = submodel.stateless_call(state, argument, **saved_side_inputs)
  jax.effects_barrier()
  return IsolatedSubmodel(
    submodel=submodel,
    saved_arg=saved_arg,
    saved_side_inputs=saved_side_inputs,
    saved_output=output,
    initial_var_values=state,
    final_var_values=final,
  )
