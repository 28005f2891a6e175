"""Isolate one call of a converted model, with what it saw, so it can be replayed alone.

`isolate` resolves `at` to one call node of the tree and runs a copy of the whole tree
once, eagerly, with a `Recorder` on that call (`core._recorder`): every native execution
is recorded with its arguments, output and what its module held before and after,
through `jax.debug.callback` inside compiled bodies (once per iteration or batch
member). The node's `FrameworkAdapter` turns each execution into an `IsolatedSubmodel`:
the call converted on its own, parameters frozen in, state unbound into slots (and, for
Linen, its rng state attached), so `submodel.stateless_call(initial_var_values,
saved_arg, **saved_side_inputs)` reproduces `saved_output` and `final_var_values` bit
for bit. Framework-neutral: no Flax internals here.
"""

from __future__ import annotations

from typing import Any

import jax

from flaxlens.core._adapter import FrameworkAdapter, adapter_of
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._checks import check_type, refuse
from flaxlens.core._node import CallNode, is_call_node
from flaxlens.core._recorder import Execution, Recorder, standalone
from flaxlens.core._runtime import resolve_random_streams, run_tree
from flaxlens.core._selectors import Selection, select
from flaxlens.core._variables import Uninitialized, scratch_copy
from flaxlens.core._walk import pristine
from flaxlens.errors import (
  ArgumentError,
  FlaxlensError,
  SelectionError,
  UnsupportedFlaxFeatureError,
)
from flaxlens.tools.base._calling import model_arguments, takes_model_arguments
from flaxlens.tools.isolation._replay import IsolatedSubmodel


@takes_model_arguments('fl.isolate(fl.unflaxify(model, variables, x), x, "Block_0/Dense_1")')
def isolate(
  tree: CallNode,
  args: Any,
  /,
  at: Any,
  *,
  every: bool = False,
  random_streams: Any = None,
) -> IsolatedSubmodel | tuple[IsolatedSubmodel, ...]:
  """Isolates the call `at` of a converted tree, as it ran on `args`, to replay it alone.

  The tree runs once, eagerly, on a copy of its variables (yours are not modified),
  and the call is cut out with what it received, what its module held before and after,
  and the random state it drew from. A call inside `nn.scan`/`nnx.scan` runs once per
  iteration (inside `vmap`, once per member): `every=True` returns one submodel per
  execution.

  Args:
    tree: a converted tree (`fl.unflaxify`). A plain Flax model is refused: convert it
      first, `fl.isolate(fl.unflaxify(model, variables, x), x, "Block_0")`.
    args: the model's arguments, as `fl.run` takes them: one value (its only positional
      argument), a tuple of positional arguments, or `fl.ArgsAndKwargs.capture(*args,
      **kwargs)` for keyword arguments too.
    at: the one call to isolate: a path pattern as `tree.select().at_path` takes it
      (`"Block_0/Dense_1"`, `"**/mlp"`, `"embed.attend"`; `""` is the root), a
      `Selection` of this tree holding one call, or a `CallNode` of the tree (the second
      call of a shared module, for example).
    every: return a tuple with one submodel per execution of the call, in execution
      order (empty if it never ran), instead of requiring exactly one execution.
    random_streams: Linen rng keys, as a tree call takes them; an `fl.RandomStream`
      gives the key a tree call would draw next, and is not advanced (NNX models keep
      theirs in the model, or take an `nnx.Rngs` among their arguments).

  Returns:
    The `IsolatedSubmodel` (`isolated.replay()` re-runs it and compares), or with
    `every=True` a tuple of them, `call_number` counting the executions from 0.

  Raises:
    ArgumentError: if `tree` is not a converted tree, or `at` not one of the above.
    SelectionError: if `at` matches no call of the tree or several.
    FlaxlensError: without `every=True`, if the call never ran on `args` or ran several
      times.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.Dropout(0.5, deterministic=False)])
    >>> x = jnp.ones((2, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> rngs = {"dropout": jax.random.key(1)}
    >>> tree = fl.unflaxify(model, variables, x, rngs=rngs)
    >>> isolated = fl.isolate(tree, x, "layers_1", random_streams=rngs)
    >>> isolated.saved_arg.args[0].shape, bool(isolated.replay())
    ((2, 4), True)

    Inside `nn.scan`, one submodel per iteration:

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
    >>> calls = fl.isolate(tree, x, "**/Dense_0", every=True)
    >>> [(c.call_number, bool(c.replay())) for c in calls]
    [(0, True), (1, True), (2, True)]
  """
  where = "fl.isolate"
  if not isinstance(tree, CallNode):
    raise refuse(
      where,
      "tree",
      tree,
      "a converted tree",
      "Convert the model first and pass its arguments as one value:"
      ' fl.isolate(fl.unflaxify(model, variables, x), x, "Block_0/Dense_1") (NNX:'
      ' fl.isolate(fl.unflaxify(model, x), x, "blocks/linear")).',
    )
  check_type(every, bool, where, "every", "True or False", "Pass every=True or every=False.")
  argument = model_arguments(args)
  node, keypath = _call_at(tree, at, where)
  found = _isolate_executions(tree, node, keypath, argument, random_streams)
  if every:
    return found
  if len(found) != 1:
    raise FlaxlensError(
      f"{node.where()} ran {len(found)} times in this call"
      + (
        " (inside nn.scan or nn.vmap, or called again by a replacement); pass every=True"
        " to get one isolated submodel per execution."
        if found
        else "; it was never called with these arguments, so there is nothing to isolate."
        " Give arguments that take the branch that calls it."
      )
    )
  return found[0]


def _call_at(tree: CallNode, at: Any, where: str) -> tuple[CallNode, Any]:
  """The one call node `at` names in `tree`, and its key path."""
  if isinstance(at, Selection):
    if at.deselect() is not tree:
      raise ArgumentError(
        f"{where}: at is a selection of another tree than {tree.where()}. Select in the"
        ' tree you pass: tree.select().at_path("Block_0/Dense_1").'
      )
    selection = at
  elif isinstance(at, str):
    selection = tree.select().at_path(at)
  elif isinstance(at, CallNode):
    selection = tree.select().at_subtrees_where(lambda x: x is at)
    if not selection.count():
      raise SelectionError(
        f"The call node {at.where()} is not a call of {tree.where()}. Give a node of this"
        " tree (tree.select().at_path(...).get()) or its path pattern."
      )
  else:
    raise refuse(
      where,
      "at",
      at,
      "a path pattern (str), a Selection of the tree or one of its CallNodes",
      'Pass the path of the call, for example "Block_0/Dense_1".',
    )
  nodes = selection.get_sequence()
  if len(nodes) != 1:
    named = ", ".join(n.where() if is_call_node(n) else type(n).__name__ for n in nodes[:8])
    raise SelectionError(
      f"{where} isolates one call, but {_shown_at(at)} selects {len(nodes)}"
      + (f": {named}{' ...' if len(nodes) > 8 else ''}" if nodes else "")
      + ". Give exactly one call: a longer path, or the call node itself"
      " (tree.select().at_path(...).get_sequence()[i])."
    )
  if not is_call_node(nodes[0]):
    raise SelectionError(
      f"{where} isolates a converted call, but the selection holds a"
      f" {type(nodes[0]).__name__}. Select a call node (fl.unflaxify gives a tree of them)."
    )
  return nodes[0], selection.keypaths[0]


def _shown_at(at: Any) -> str:
  if isinstance(at, str):
    return f"the path {at!r}"
  return "the selection" if isinstance(at, Selection) else "the node"


def _isolate_executions(
  root: CallNode, node: CallNode, keypath: Any, argument: ArgsAndKwargs, random_streams: Any
) -> tuple[IsolatedSubmodel, ...]:
  """Every execution of `node` (at `keypath` in `root`) in one run of `root` on `argument`."""
  adapter = adapter_of(root)
  if not pristine(node):
    raise UnsupportedFlaxFeatureError(
      f"{node.where()}: calls inside it are replaced; isolate it before patching it."
    )
  adapter.check_isolatable(node)
  # Isolation runs a copy: the caller's RandomStreams do not advance.
  random_streams = resolve_random_streams(random_streams, "fl.isolate", advance=False)
  # Stateful objects among the arguments (an nnx.Rngs) advance in a run: use a copy.
  argument = jax.tree_util.tree_map(lambda x: x, argument)
  copy = scratch_copy(root)
  target = select(copy).at_keypaths([keypath]).get()
  if target is copy:
    return (_isolate_root(copy, argument, random_streams),)
  interceptor = adapter.new_interceptor(copy, {})
  interceptor.recorder = Recorder(target)
  run_tree(copy, argument, random_streams, {}, interceptor=interceptor)
  jax.effects_barrier()
  return tuple(
    _isolated(adapter, execution, number)
    for number, execution in enumerate(interceptor.recorder.executions)
  )


def _isolated(adapter: FrameworkAdapter, execution: Execution, number: int) -> IsolatedSubmodel:
  submodel, state, final_values = adapter.isolated_call(execution)
  final = tuple(
    type(v)(value=final_values.get(v.label, Uninitialized()), label=v.label) for v in state
  )
  return IsolatedSubmodel(
    submodel=submodel,
    saved_arg=execution.argument,
    saved_side_inputs={},
    saved_output=execution.output,
    initial_var_values=state,
    final_var_values=final,
    call_number=number,
    recorded_compiled=execution.compiled,
  )


def _isolate_root(root: CallNode, argument: ArgsAndKwargs, random_streams: Any) -> IsolatedSubmodel:
  submodel, state = standalone(root)
  saved_side_inputs = {} if random_streams is None else {"random_streams": random_streams}
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
