"""Running a converted tree: gather its variables, run the root natively, write back.

A call of a root node gathers the entries (variables, frozen values, plain values) of
every node whose variables the run uses (`own_call_nodes`) by key, asks the node's
`FrameworkAdapter` for a native run on their values, runs it once while the adapter's
interceptor dispatches every submodule call (`_calls`), checks that every replaced call
was reached, and writes the updated values back into the tree's variables. A run that
fails inside the model's own code raises a `ModelCallError` from the original error
(`_call_failure`). The same code runs Linen and NNX trees. No Flax internals here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import jax
import numpy as np

from flaxlens.core._active import current_interceptor
from flaxlens.core._adapter import adapter_of
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._cache import Derived
from flaxlens.core._call_failure import explain
from flaxlens.core._call_variables import fixed_scope_data
from flaxlens.core._calls import CallInterceptor, Frame
from flaxlens.core._inner_jit import RunToken
from flaxlens.core._node import CallNode
from flaxlens.core._probes import Probing, carrying_out
from flaxlens.core._random import RandomStream, detached
from flaxlens.core._variables import (
  AbstractVariable,
  AbstractVariableSlot,
  AbstractVariableValue,
  check_storable,
)
from flaxlens.core._walk import calls_fixed, own_call_nodes
from flaxlens.errors import ArgumentError, CallStructureError, FlaxlensError, VariableError


class Gathered:
  """The variables of one run, gathered from the nodes of a tree by key.

  Attributes:
    entries: `{key: entry}`, each variable once (a `Parameter`, `StateVariable`, frozen
      value, or plain value).
    values: `{key: value}`, the entries' current values (`Uninitialized` included).
    info: `{key: what the adapter needs to rebuild the variable}`.
    entry_ids: the ids of the entries (what a run's `RunToken` leaves out).

  Which entries a run gathers is worked out once per root node where it cannot change
  (`_is_fixed`, kept with `core/_cache.py`); their values are read at every call.
  """

  def __init__(self, root: CallNode):
    layout = _LAYOUT(root)
    self.entries = layout.entries
    self.info = layout.info
    self.entry_ids = layout.entry_ids
    self.values: dict[Any, Any] = {key: value_of(e, n) for key, e, n in layout.owned}


class _Layout:
  """The entries a run of `root` gathers: `(key, entry, node)` for each, in order."""

  __slots__ = ("entries", "info", "owned", "entry_ids")

  def __init__(self, root: CallNode):
    adapter = adapter_of(root)
    self.entries: dict[Any, Any] = {}
    self.info: dict[Any, Any] = {}
    owned: list[tuple[Any, Any, CallNode]] = []
    prefix = root.path
    for node in own_call_nodes(root):
      if node.path[: len(prefix)] != prefix:
        raise FlaxlensError(
          f"{root.where()}: this call uses the module at"
          f" {'/'.join(map(str, node.path))!r}, which lives outside it; call the enclosing"
          " tree instead."
        )
      for key, entry, info in adapter.entries(node, node.path[len(prefix) :]):
        seen = self.entries.get(key, _ABSENT)
        if seen is not _ABSENT:
          if not same_entry(seen, entry):
            raise FlaxlensError(
              f"{node.where()}: two calls of the module hold different values for"
              f" {adapter.key_name(key)}. Calls of one module share their variables;"
              " edit the shared variable's .value instead of replacing it in one call."
            )
          continue
        self.entries[key] = entry
        self.info[key] = info
        owned.append((key, entry, node))
    self.owned = tuple(owned)
    self.entry_ids = frozenset(map(id, self.entries.values()))


def _is_fixed(root: CallNode) -> bool:
  """Whether the entries of a run of `root` can never change.

  True for a converted tree whose calls are all its own: every `submodule_calls` and
  scope data dict below `root` is read-only, so no entry can be added, removed or
  swapped (values change, and are read at every call). A hand-built node or a
  replacement layer anywhere below is gathered afresh at every call.
  """
  return calls_fixed(root) and all(fixed_scope_data(n.scope_data) for n in own_call_nodes(root))


_LAYOUT = Derived("gathered", _Layout, lambda root, _: _is_fixed(root))


_ABSENT = object()


def run_tree(
  root: CallNode,
  argument: ArgsAndKwargs,
  random_streams: Any,
  side_inputs: dict[str, Any],
  interceptor: CallInterceptor | None = None,
  probing: Probing | None = None,
  probing_key: Any = None,
) -> Any:
  """Runs `root` natively once, its submodule calls dispatched by `interceptor`.

  `interceptor` defaults to the adapter's plain one; one with a recorder (see
  `_recorder`) records executions on the way, and keeps a token of its own so that
  inner jits trace afresh and report to it. With `probing` (see `_probes`), the run
  applies its interventions and captures at the probed nodes; `probing_key` is what
  the probes bake into traces (inner jits key on it) and `probing.results()` holds the
  captures afterwards.
  """
  adapter = adapter_of(root)
  root.check_runs_alone(
    "be called on its own. Call the tree it belongs to (patches inside it apply at every iteration)"
  )
  gathered = Gathered(root)
  # A tree a replacement runs inside a probed run (a spliced module: `_walk`'s `NESTED`)
  # is probed by that run: its calls are sites of the outer tree.
  outer = getattr(current_interceptor(), "probing", None) if probing is None else None
  if interceptor is None:
    interceptor = adapter.new_interceptor(root, side_inputs)
    if outer is None:  # Plain runs of one tree share inner-jit traces; others keep their own.
      interceptor.token = RunToken(
        interceptor,
        (root, side_inputs, probing_key),
        gathered.entry_ids,
      )
  run = adapter.native_run(root, gathered, random_streams, interceptor)
  method = root.method_name
  frame = Frame(root.path, node=root, absorb=interceptor.reported_name(method))
  interceptor.frames.append(frame)
  try:
    if probing is None and outer is None:
      with interceptor.active():
        output, updates = run(argument)
    elif probing is None:
      output, updates = _run_nested(root, run, argument, interceptor, outer)
    else:
      output, updates = _run_probed(root, run, argument, interceptor, probing)
  except Exception as e:  # Free unless raised: explained only after a failure.
    explained = explain(root, argument, e)
    if explained is None:
      raise
    raise explained from e
  interceptor.check_reached(frame)
  write_back(root, gathered, updates)
  return output


def _run_probed(
  root: CallNode, run: Any, argument: ArgsAndKwargs, interceptor: CallInterceptor, probing: Probing
) -> Any:
  interceptor.probing = probing
  updates: list[Any] = []

  def call(args: Any, kwargs: Any) -> Any:
    output, changed = run(ArgsAndKwargs(args=tuple(args), kwargs=dict(kwargs)))
    updates.append(changed)
    return output

  with (
    interceptor.active(),
    carrying_out() if probing.capturing or probing.indexed else nullcontext(),
  ):
    with probing.channel():
      edited = probing.edited_calls.get(id(root))
      if edited is None:
        output = call(argument.args, argument.kwargs)
      else:
        output = edited.around(lambda a: call(a.args, a.kwargs), argument, probing)
      probing.captured = probing.results()
  return output, updates[-1]


def _run_nested(
  root: CallNode, run: Any, argument: ArgsAndKwargs, interceptor: CallInterceptor, probing: Probing
) -> Any:
  """Runs a nested tree under the probing of the run it is called in: its probed calls
  are edited and captured into that run's channels (no channel of its own)."""
  interceptor.probing = probing
  with interceptor.active():
    edited = probing.edited_calls.get(id(root))
    if edited is None:
      return run(argument)
    updates: list[Any] = []

    def call(a: ArgsAndKwargs) -> Any:
      output, changed = run(a)
      updates.append(changed)
      return output

    output = edited.around(call, argument, probing)
  return output, updates[-1]


def write_back(root: CallNode, gathered: Gathered, updates: Mapping[Any, Any]) -> None:
  """Stores the values a run of `root` changed into the tree's variables.

  Raises:
    CallStructureError: if the run created variables conversion did not see.
  """
  where = root.where()
  unknown = [k for k in updates if k not in gathered.entries]
  if unknown:
    names = [adapter_of(root).key_name(k) for k in unknown[:6]]
    raise CallStructureError(
      f"{where}: this call created variables that did not exist at conversion:"
      f" {names}. Convert with example arguments that create them (for example the"
      " same flags), so the tree has state variables to hold them."
    )
  changed = [
    (gathered.entries[key], value)
    for key, value in updates.items()
    if value is not gathered.values[key]
  ]
  frozen = [
    e.label
    for e, value in changed
    if isinstance(e, AbstractVariableValue) and not _same_bits(e.value, value)
  ]
  if frozen:
    raise VariableError(
      f"{where}: this call updates {frozen[:6]}, which the tree holds frozen"
      " (fl.freeze_variables), so the update would be lost. Call a tree whose state is"
      " StateVariables, or unbind the state and use stateless_call, which returns it."
    )
  changed = [(e, v) for e, v in changed if isinstance(e, AbstractVariable)]
  for entry, value in changed:
    check_storable(entry, value, where)
  for entry, value in changed:
    entry.value = value


def _same_bits(old: Any, new: Any) -> bool:
  """Whether `new`, the value a run gives back for a frozen value `old`, is `old` again
  as a new array of the same bits (a jitted call, such as an `nnx.jit` method, returns
  every variable it is given as a new array). Traced values cannot be told: False."""
  arrays = (jax.Array, np.ndarray)
  if not (isinstance(old, arrays) and isinstance(new, arrays)):
    return False
  if isinstance(old, jax.core.Tracer) or isinstance(new, jax.core.Tracer):
    return False
  if old.shape != new.shape or old.dtype != new.dtype:
    return False
  if jax.dtypes.issubdtype(old.dtype, jax.dtypes.prng_key):
    old, new = jax.random.key_data(old), jax.random.key_data(new)
  return np.asarray(old).tobytes() == np.asarray(new).tobytes()


def resolve_random_streams(random_streams: Any, where: str, advance: bool = True) -> Any:
  """`random_streams` with each `RandomStream` replaced by its next key (the stream
  advances unless `advance` is False) and each raw key held as a NumPy uint32 array
  (as Flax's `rngs=` takes it) by that key as a JAX array.

  A single key (as Flax takes `rngs=key`) and None pass through.

  Raises:
    ArgumentError: for a stream that is neither a JAX key nor a `RandomStream`.

  Example:
    >>> import flaxlens as fl, jax
    >>> from flaxlens.core._runtime import resolve_random_streams
    >>> stream = fl.RandomStream.from_base_key(jax.random.key(0))
    >>> keys = resolve_random_streams({"dropout": stream}, "f")
    >>> sorted(keys)
    ['dropout']
  """
  if random_streams is None or not isinstance(random_streams, Mapping):
    return random_streams
  keys = {}
  for name, stream in random_streams.items():
    if isinstance(stream, RandomStream):
      keys[name] = (stream if advance else detached(stream)).next_key()
    elif isinstance(stream, jax.Array):
      keys[name] = stream
    elif isinstance(stream, np.ndarray) and stream.dtype == np.uint32:
      keys[name] = jax.numpy.asarray(stream)
    else:
      raise ArgumentError(
        f"{where}: random_streams[{name!r}] must be a JAX key or an fl.RandomStream,"
        f" got {type(stream).__name__}"
        + (
          f" of {stream.dtype}. A raw key is uint32: pass jax.random.key(seed)."
          if isinstance(stream, np.ndarray)
          else ". Pass for example jax.random.key(0)."
        )
      )
  return keys


def value_of(entry: Any, node: CallNode) -> Any:
  """The value held by a variable, a frozen value or a plain value of `node`.

  Raises:
    FlaxlensError: for a slot, naming the node's call and how to bind it.
  """
  if isinstance(entry, AbstractVariable | AbstractVariableValue):
    return entry.value
  if isinstance(entry, AbstractVariableSlot):
    raise FlaxlensError(
      f"{node.where()}: the variable {entry.label!r} is unbound (a slot). Bind it with"
      " fl.bind_variables(tree, values), or call the tree through stateless_call."
    )
  return entry


_IMMUTABLE_LEAVES = (
  jax.Array,
  jax.ShapeDtypeStruct,
  np.generic,
  int,
  float,
  complex,
  str,
  bytes,
  type(None),
)


def private_value(value: Any) -> Any:
  """`value` with every leaf that can change in place copied, JAX arrays shared.

  A model run on a tree's values may update them in place (NNX's `v[...] = ...` on a
  NumPy array writes into it); the run gets copies of such leaves (NumPy arrays and any
  other mutable object), so the caller's buffers never change. JAX arrays, tracers and
  Python scalars are immutable and stay shared.

  Example:
    >>> import numpy as np, jax.numpy as jnp
    >>> from flaxlens.core._runtime import private_value
    >>> a, b = np.zeros(2), jnp.zeros(2)
    >>> private_value(a) is a, private_value(b) is b
    (False, True)
  """
  if isinstance(value, _IMMUTABLE_LEAVES):
    return value
  return jax.tree_util.tree_map(_private_leaf, value)


def _private_leaf(leaf: Any) -> Any:
  if isinstance(leaf, _IMMUTABLE_LEAVES):
    return leaf
  if isinstance(leaf, np.ndarray):
    return leaf.copy()
  return copy.deepcopy(leaf)


def same_entry(a: Any, b: Any) -> bool:
  """Whether two entries found for one variable in two calls of its module agree.

  Bound variables must be the same object. Frozen or plain values agree when they are
  the same value; under a JAX transformation one shared value arrives as two tracers,
  which cannot be told apart, so tracers agree.
  """
  if a is b:
    return True
  if isinstance(a, AbstractVariable) or isinstance(b, AbstractVariable):
    return False
  if isinstance(a, AbstractVariableValue) or isinstance(b, AbstractVariableValue):
    if not (isinstance(a, AbstractVariableValue) and isinstance(b, AbstractVariableValue)):
      return False
    if a.label != b.label:
      return False
    a, b = a.value, b.value
  leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(leaves_a) == len(leaves_b) and all(
    x is y or isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer)
    for x, y in zip(leaves_a, leaves_b, strict=True)
  )
