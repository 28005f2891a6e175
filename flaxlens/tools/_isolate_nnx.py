"""Isolating calls of an NNX tree: the NNX half of `fl.isolate_calls`.

While a private copy of the model runs, every execution of the selected call records
its module's `GraphDef`, its variable values before and after, its arguments and its
output (through `jax.debug.callback` inside `nnx.scan`/`nnx.vmap` bodies). Each
execution's module is rebuilt as a plain NNX module from those values and converted on
its own; NNX keeps random state in its variables, so no rng state needs attaching. Flax
internals: the instrumentation helpers of `flaxlens.nnx._tree`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from flaxlens import _flax_internals as fi
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._variables import (
  Parameter,
  Uninitialized,
  freeze_variables,
  unbind_variables,
)
from flaxlens.errors import UnsupportedFlaxFeatureError
from flaxlens.nnx._tree import (
  InterceptedNNXModuleMethod,
  NNXInterceptor,
  _run,
  plain_module,
  split_leaves,
)
from flaxlens.tools._isolate import IsolatedSubmodel, _export


class _Observing(NNXInterceptor):
  """Runs the private copy as usual and records every execution of one node."""

  def __init__(self, target: InterceptedNNXModuleMethod, **kwargs: Any):
    super().__init__(**kwargs)
    self.target = target
    self.executions: list[tuple[Any, ...]] = []

  def run_node(self, node, module, next_fun, args, kwargs):
    if node is not self.target:
      return super().run_node(node, module, next_fun, args, kwargs)
    _refuse_graph_arguments(node, (args, kwargs))
    graphdef, before = split_leaves(module)
    output = super().run_node(node, module, next_fun, args, kwargs)
    after_graphdef, after = split_leaves(module)
    payload = (tuple(args), dict(kwargs), before, output, after)
    receive = functools.partial(
      self._finish, graphdef, after_graphdef, node.method_name, fi.runs_compiled()
    )
    _export(payload, receive)
    return output

  def _finish(self, graphdef, after_graphdef, method, compiled, payload) -> None:
    self.executions.append((graphdef, after_graphdef, method, compiled, *payload))


def _refuse_graph_arguments(node: InterceptedNNXModuleMethod, arguments: Any) -> None:
  leaves = jax.tree_util.tree_leaves(arguments, is_leaf=lambda x: isinstance(x, nnx.Pytree))
  if any(isinstance(x, nnx.Pytree | nnx.Variable) for x in leaves):
    raise UnsupportedFlaxFeatureError(
      f"{node._where()}: the call receives NNX objects (modules, Rngs or variables) as"
      " arguments, which isolating does not support yet. Isolate the call that owns them."
    )


def isolate_nnx_calls(
  root: InterceptedNNXModuleMethod,
  target: InterceptedNNXModuleMethod,
  argument: ArgsAndKwargs,
  side_inputs: dict[str, Any],
) -> tuple[IsolatedSubmodel, ...]:
  observer = _Observing(target, side_inputs=side_inputs, building=False)
  _run(root, argument, side_inputs, interceptor=observer)
  jax.effects_barrier()
  return tuple(
    _isolated(execution, side_inputs, number)
    for number, execution in enumerate(observer.executions)
  )


def _labels(graphdef: Any, leaves: list[Any]) -> dict[str, Any]:
  """`{label: value}` for a module's variables, labelled as conversion labels them."""
  from flaxlens.nnx._convert import _readable

  module = plain_module(graphdef, leaves)
  return {
    f"{type(v).__name__}:{_readable(tuple(p))}": v.get_raw_value()
    for p, v in nnx.to_flat_state(nnx.state(module))
  }


def nnx_submodel(
  module: nnx.Module, method: Any, argument: ArgsAndKwargs
) -> tuple[InterceptedNNXModuleMethod, tuple[Any, ...]]:
  """An NNX call as a submodel: converted on its own, parameters frozen, state unbound.

  Returns the submodel and its state variables' initial values.
  """
  from flaxlens.nnx._convert import unflaxify_nnx

  tree = unflaxify_nnx(module, *argument.args, method=method, **argument.kwargs)
  frozen = freeze_variables(tree, lambda v: isinstance(v, Parameter))
  return unbind_variables(frozen, freeze=True)


def _isolated(execution: tuple[Any, ...], side_inputs: dict[str, Any], number: int):
  graphdef, after_graphdef, method, compiled, args, kwargs, before, output, after = execution
  argument = ArgsAndKwargs(args=args, kwargs=kwargs)
  submodel, state = nnx_submodel(plain_module(graphdef, before), method, argument)
  final_values = _labels(after_graphdef, after)
  final = tuple(
    type(v)(value=final_values.get(v.label, Uninitialized()), label=v.label) for v in state
  )
  return IsolatedSubmodel(
    submodel=submodel,
    saved_arg=argument,
    saved_side_inputs=dict(side_inputs),
    saved_output=output,
    initial_var_values=state,
    final_var_values=final,
    call_number=number,
    recorded_compiled=compiled,
  )
