"""Recording the executions of one call while its whole model runs, for isolation.

A `Recorder` is attached to the interceptor of one run (`CallInterceptor.recorder`).
Every native execution of its target node passes through `observe`: the node's
`FrameworkAdapter` records what the call starts from (variables, rng state) and what it
leaves, and the arguments and output are kept with them. Inside compiled bodies
(`nn.scan`, `nnx.vmap`, inner jits) these are tracers, so they leave through
`jax.debug.callback` (`deliver`), once per iteration or batch member. The adapter turns
each `Execution` into a standalone submodel (`standalone`). Flax internals: only
`runs_compiled`, through `flaxlens._compat.tracing`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from flaxlens._compat import tracing
from flaxlens.core._adapter import adapter_of
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._calls import CallInterceptor
from flaxlens.core._node import CallNode
from flaxlens.core._variables import Parameter, freeze_variables, unbind_variables


@dataclasses.dataclass
class Execution:
  """What one native execution of a recorded call saw, with concrete values.

  Attributes:
    argument: the call's arguments.
    output: what it returned.
    static_before: what the adapter kept of the start that is not an array.
    before: the arrays the adapter recorded at the start (variables, rng keys).
    static_after: what the adapter kept of the end that is not an array.
    after: the arrays the adapter recorded at the end (variables).
    compiled: whether the call ran as compiled code (inside jit or a scan body).
  """

  argument: ArgsAndKwargs
  output: Any
  static_before: Any
  before: Any
  static_after: Any
  after: Any
  compiled: bool


class Recorder:
  """Records every execution of `target` in the run it is attached to."""

  def __init__(self, target: CallNode):
    self.target = target
    self.executions: list[Execution] = []

  def observe(
    self,
    interceptor: CallInterceptor,
    node: CallNode,
    module: Any,
    args: Any,
    kwargs: Any,
    run: Callable[[], Any],
  ) -> Any:
    """Runs the execution of the target (`run`) and records it."""
    adapter = adapter_of(node)
    static_before, before = adapter.record_before(interceptor, node, module, args, kwargs)
    output = run()
    static_after, after = adapter.record_after(node, module, output)
    finish = functools.partial(self._finish, static_before, static_after, tracing.runs_compiled())
    deliver((tuple(args), dict(kwargs), before, output, after), finish)
    return output

  def _finish(self, static_before: Any, static_after: Any, compiled: bool, payload: Any) -> None:
    args, kwargs, before, output, after = payload
    argument = ArgsAndKwargs(args=args, kwargs=kwargs)
    self.executions.append(
      Execution(argument, output, static_before, before, static_after, after, compiled)
    )


def deliver(payload: Any, receive: Callable[[Any], None]) -> None:
  """Hands `payload` to `receive` with concrete values, now or when the trace runs.

  Arrays that are tracers leave through `jax.debug.callback` (call `jax.effects_barrier`
  before reading what `receive` stored); PRNG keys travel as their key data.
  """
  leaves, treedef = jax.tree_util.tree_flatten(payload)
  traced = [isinstance(x, jax.Array | np.ndarray) for x in leaves]
  key_impls = [
    jax.random.key_impl(x) if t and is_key(x) else None for x, t in zip(leaves, traced, strict=True)
  ]
  arrays = [
    jax.random.key_data(x) if impl is not None else x
    for x, t, impl in zip(leaves, traced, key_impls, strict=True)
    if t
  ]

  def rebuild(*values: Any) -> None:
    it = iter(values)
    out = []
    for leaf, t, impl in zip(leaves, traced, key_impls, strict=True):
      if not t:
        out.append(leaf)
        continue
      value = jax.numpy.asarray(next(it))
      out.append(jax.random.wrap_key_data(value, impl=impl) if impl is not None else value)
    receive(jax.tree_util.tree_unflatten(treedef, out))

  if any(isinstance(a, jax.core.Tracer) for a in arrays):
    jax.debug.callback(rebuild, *arrays)
  else:
    rebuild(*arrays)


def is_key(x: Any) -> bool:
  """Whether `x` is a typed PRNG key array."""
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def standalone(tree: CallNode) -> tuple[CallNode, tuple[Any, ...]]:
  """`tree` as a submodel: parameters frozen in, state variables unbound into slots.

  Returns the submodel and its state variables' values, as `stateless_call` takes them.
  """
  frozen = freeze_variables(tree, lambda v: isinstance(v, Parameter))
  return unbind_variables(frozen, freeze=True)
