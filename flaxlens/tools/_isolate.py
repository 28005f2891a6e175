"""Isolate one call of a converted model, with what it saw, so it can be replayed alone.

`isolate_calls` runs a copy of the whole tree once, eagerly, and observes every native
execution of the selected call: its arguments, output, the variables its module saw
before and after, and its scope's rng state. Inside `nn.scan`/`nn.vmap`/`nn.jit` bodies
these are tracers, so they leave through `jax.debug.callback`, once per iteration or
batch member. Each execution becomes an `IsolatedSubmodel`: the call converted on its own
from those variables, parameters frozen in, state unbound into slots, rng state attached,
so `submodel.stateless_call(initial_var_values, saved_arg, **saved_side_inputs)`
reproduces `saved_output` and `final_var_values` bit for bit. Flax internals used: the
rng snapshot and module variables, through `flaxlens._flax_internals`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from flaxlens import _flax_internals as fi
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._calls import CallNode, is_call_node, pristine
from flaxlens.core._jit import variable_jit
from flaxlens.core._names import split_name
from flaxlens.core._selectors import Selection, select
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._variables import (
  Parameter,
  Uninitialized,
  bind_variables,
  freeze_variables,
  unbind_variables,
)
from flaxlens.errors import ArgumentError, FlaxlensError, UnsupportedFlaxFeatureError
from flaxlens.linen._tree import (
  InterceptedFlaxModuleMethod,
  LinenInterceptor,
  RngSnapshot,
  apply_tree,
  flatten_collections,
)


class IsolatedSubmodel(Struct):
  """One execution of one call, cut out of a model with everything needed to replay it.

  Attributes:
    submodel: the call as a layer of its own; parameters are frozen in, state variables
      are slots.
    saved_arg: the `ArgsAndKwargs` the call received (Python values stay Python values).
    saved_side_inputs: the side inputs to pass when replaying.
    saved_output: what the call returned.
    initial_var_values: the state variables' values before the call.
    final_var_values: their values after the call, in the order `stateless_call`
      returns them.
    call_number: which execution of the selected call this is (0 for the first; inside
      `nn.scan` the iteration, inside `nn.vmap` the batch member).
    recorded_compiled: whether the call ran as compiled code when it was recorded: inside
      `nn.jit`/`nnx.jit`, or in the body of `nn.scan`/`nnx.scan` (a `lax.scan`, compiled
      even when the model runs eagerly) or of another compiling transform. `replay()`
      runs it the same way by default.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(4), nn.relu]), jnp.ones((1, 3))
    >>> isolated = fl.isolate(model, model.init(jax.random.key(0), x), x, at="layers_0")
    >>> output, _ = isolated.submodel.stateless_call(
    ...   isolated.initial_var_values, isolated.saved_arg, **isolated.saved_side_inputs)
    >>> bool((output == isolated.saved_output).all()), isolated.replay().exact
    (True, True)
  """

  submodel: Any
  saved_arg: Any
  saved_side_inputs: dict[str, Any]
  saved_output: Any
  initial_var_values: tuple[Any, ...]
  final_var_values: tuple[Any, ...]
  call_number: int = static_field(default=0)
  recorded_compiled: bool = static_field(default=False)

  def replay(self, jit: bool | None = None) -> ReplayReport:
    """Re-runs the submodel on the saved inputs and compares with the saved results, bit for bit.

    Args:
      jit: None (the default) runs the call as it ran when recorded: under `jax.jit` if
        it was recorded in compiled code (`recorded_compiled`), else eagerly, which
        reproduces the saved results bit for bit. True or False forces a mode; the other
        mode can differ in the last bits, because XLA rounds a compiled program (fused,
        reassociated operations) differently from the same operations run one by one.
        Python-valued arguments stay static under jit.

    Returns:
      A `ReplayReport`; it is truthy only when every output and state leaf matches bit
      for bit.

    Example:
      >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
      >>> model = nn.Sequential([nn.Dense(4), nn.gelu, nn.Dense(2)])
      >>> x = jnp.ones((1, 3))
      >>> isolated = fl.isolate(model, model.init(jax.random.key(0), x), x, at="layers_2")
      >>> isolated.recorded_compiled, bool(isolated.replay())
      (False, True)
    """
    compiled = self.recorded_compiled if jit is None else jit
    # A copy, so stateful objects among the arguments (an nnx.Rngs) start as saved.
    saved_arg = jax.tree_util.tree_map(lambda x: x, self.saved_arg)
    if compiled:
      bound = bind_variables(self.submodel, self.initial_var_values)
      run = variable_jit(lambda layer, arg, side: layer(arg, **side))
      output = run(bound, saved_arg, self.saved_side_inputs)
      _, state = unbind_variables(bound, freeze=True)
      state = tuple(v for v in state if v.label in {f.label for f in self.final_var_values})
    else:
      output, state = self.submodel.stateless_call(
        self.initial_var_values, saved_arg, **self.saved_side_inputs
      )
    expected = {"output": self.saved_output, "state": _by_label(self.final_var_values)}
    report = ReplayReport.compare({"output": output, "state": _by_label(state)}, expected)
    if compiled == self.recorded_compiled:
      return report
    return dataclasses.replace(report, note=_OTHER_MODE_NOTE[self.recorded_compiled])


_OTHER_MODE_NOTE = {
  True: (
    "recorded in compiled code (inside jit, or a scan body) but replayed eagerly, one"
    " operation at a time, which XLA can round differently in the last bits; replay()"
    " with the default jit=None reproduces the recording."
  ),
  False: (
    "recorded eagerly, one operation at a time, but replayed under jit, whose compiled"
    " program XLA can round differently in the last bits; replay() with the default"
    " jit=None reproduces the recording."
  ),
}


def _by_label(values: tuple[Any, ...]) -> dict[str, Any]:
  return {v.label: v.value for v in values}


@dataclasses.dataclass(frozen=True)
class ReplayReport:
  """Per-leaf comparison of a replay with the saved results: bits, and the distance.

  Attributes:
    identical: `{leaf path: whether shape, dtype and every bit match}`; `+0.0` and
      `-0.0`, or two NaNs with different payloads, are different bits.
    max_abs_diff: `{leaf path: max |replayed - saved|}` (0.0 where the values are equal,
      even if their bits are not; inf when shapes, dtypes or structure differ, or a NaN
      faces a number).
    note: why a replay in a mode other than the recorded one may differ ("" otherwise).

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> report = fl.ReplayReport.compare({"y": jnp.array([-0.0])}, {"y": jnp.array([0.0])})
    >>> bool(report), report.max_abs_diff["['y']"]
    (False, 0.0)
  """

  identical: dict[str, bool]
  max_abs_diff: dict[str, float]
  note: str = ""

  @property
  def exact(self) -> bool:
    """Whether every leaf matched bit for bit."""
    return all(self.identical.values())

  def __bool__(self) -> bool:
    return self.exact

  def __str__(self) -> str:
    width = max((len(k) for k in self.identical), default=0)
    lines = [f"{path:<{width}}  {self.verdict(path)}" for path in self.identical]
    lines.append("exact replay" if self.exact else "replay differs")
    if self.note and not self.exact:
      lines.append(f"note: {self.note}")
    return "\n".join(lines)

  def verdict(self, path: str) -> str:
    """`"match"`, or how the leaf at `path` differs."""
    if self.identical[path]:
      return "match"
    diff = self.max_abs_diff[path]
    if diff == 0.0:
      return "MISMATCH in bits only (signed zeros or NaN payloads)"
    return f"MISMATCH max diff {diff:.3g}"

  @classmethod
  def compare(cls, actual: Any, expected: Any) -> ReplayReport:
    """Compares two pytrees leaf by leaf (PRNG keys by their key data)."""
    got = dict(jax.tree_util.tree_flatten_with_path(actual, is_leaf=_is_uninitialized)[0])
    want = dict(jax.tree_util.tree_flatten_with_path(expected, is_leaf=_is_uninitialized)[0])
    identical, diffs = {}, {}
    for path in sorted(set(got) | set(want), key=jax.tree_util.keystr):
      name = jax.tree_util.keystr(path)
      identical[name], diffs[name] = _compare_leaf(
        got.get(path, _MISSING), want.get(path, _MISSING)
      )
    return cls(identical, diffs)


_MISSING = object()
_DIFFERENT = (False, float("inf"))


def _is_uninitialized(x: Any) -> bool:
  return isinstance(x, Uninitialized)


def _compare_leaf(a: Any, b: Any) -> tuple[bool, float]:
  """`(same bits, max |a - b|)` for two leaves."""
  if a is _MISSING or b is _MISSING:
    return _DIFFERENT
  if _is_uninitialized(a) or _is_uninitialized(b):
    return (True, 0.0) if _is_uninitialized(a) and _is_uninitialized(b) else _DIFFERENT
  if _is_key(a) or _is_key(b):
    if not (_is_key(a) and _is_key(b)) or jax.random.key_impl(a) != jax.random.key_impl(b):
      return _DIFFERENT
    a, b = jax.random.key_data(a), jax.random.key_data(b)
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    return _DIFFERENT
  if a.dtype.hasobject:
    same = bool(np.all(a == b))
    return (same, 0.0) if same else _DIFFERENT
  if np.array_equal(_bits(a), _bits(b)):
    return True, 0.0
  if a.dtype.kind in "iu":
    return False, float(np.max(np.abs(a.astype(np.int64) - b.astype(np.int64))))
  if a.dtype.kind not in "fc":
    return _DIFFERENT
  wide = np.complex128 if a.dtype.kind == "c" else np.float64
  a, b = a.astype(wide), b.astype(wide)
  nan_a, nan_b = np.isnan(a), np.isnan(b)
  if np.any(nan_a != nan_b):
    return _DIFFERENT
  both = nan_a & nan_b
  return False, float(np.max(np.abs(np.where(both, 0, a) - np.where(both, 0, b)), initial=0.0))


def _bits(x: np.ndarray) -> np.ndarray:
  """The raw bytes of an array, in C order (signed zeros and NaN payloads included)."""
  return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


# --- observing one call while the whole model runs ---------------------------------------


@dataclasses.dataclass
class _Execution:
  """What one native execution of the selected call saw."""

  module: Any
  method: Any
  args: tuple[Any, ...]
  kwargs: dict[str, Any]
  before: dict[str, Any]
  keys: dict[str, Any]
  suffixes: dict[str, tuple]
  counters: dict
  output: Any
  after: dict[str, Any]
  compiled: bool


class _Observing(LinenInterceptor):
  """Runs the model as usual and records every execution of one node."""

  def __init__(self, target: CallNode, capture_intermediates: Any, **kwargs: Any):
    super().__init__(**kwargs)
    self.target = target
    self.capture_filter = fi.capture_filter(capture_intermediates)
    self.executions: list[_Execution] = []

  def run_node(self, node, module, next_fun, args, kwargs):
    if node is not self.target:
      return super().run_node(node, module, next_fun, args, kwargs)
    with fi.fields_set(module, self.edited_fields(node, module)):
      live = fi.unbound_clone(module)
    before = fi.call_variables(module)
    keys, suffixes, counters = fi.rng_snapshot(module)
    output = super().run_node(node, module, next_fun, args, kwargs)
    after = fi.call_variables(module)
    if self.capture_filter is not None and self.capture_filter(module, node.method_name):
      # Flax sows a captured output after the interceptor returns; add it as Flax will.
      sown = after.setdefault("intermediates", {})
      sown[node.method_name] = tuple(sown.get(node.method_name, ())) + (output,)
    payload = (tuple(args), dict(kwargs), before, keys, output, after)
    finish = functools.partial(
      self._finish, live, node.method_name, suffixes, counters, fi.runs_compiled()
    )
    _export(payload, finish)
    return output

  def _finish(self, module, method, suffixes, counters, compiled, payload) -> None:
    args, kwargs, before, keys, output, after = payload
    self.executions.append(
      _Execution(
        module, method, args, kwargs, before, keys, suffixes, counters, output, after, compiled
      )
    )


def _export(payload: Any, receive: Callable[[Any], None]) -> None:
  """Hands `payload` to `receive` with concrete values, now or when the trace runs."""
  leaves, treedef = jax.tree_util.tree_flatten(payload)
  traced = [isinstance(x, jax.Array | np.ndarray) for x in leaves]
  key_impls = [
    jax.random.key_impl(x) if t and _is_key(x) else None
    for x, t in zip(leaves, traced, strict=True)
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


# --- public entry points -----------------------------------------------------------------


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
  from flaxlens.nnx._tree import InterceptedNNXModuleMethod

  node, keypath = _selected_call(selection)
  root = selection.deselect()
  if not isinstance(root, InterceptedFlaxModuleMethod | InterceptedNNXModuleMethod):
    raise UnsupportedFlaxFeatureError(
      f"isolate_submodel works on a tree from fl.unflaxify; the selection's root is a"
      f" {type(root).__name__}."
    )
  if not pristine(node):
    raise UnsupportedFlaxFeatureError(
      f"{node._where()}: calls inside it are replaced; isolate it before patching it."
    )
  random_streams = _concrete_streams(side_inputs.pop("random_streams", None))
  # Stateful objects among the arguments (an nnx.Rngs) advance in a run: use a copy.
  argument = jax.tree_util.tree_map(lambda x: x, argument)
  unbound, values = unbind_variables(root, freeze=True)
  copy = bind_variables(unbound, values)
  target = select(copy).at_keypaths([keypath]).get()
  if target is copy:
    return (_isolate_root(copy, argument, random_streams, side_inputs),)
  if isinstance(copy, InterceptedNNXModuleMethod):
    from flaxlens.tools._isolate_nnx import isolate_nnx_calls

    return isolate_nnx_calls(copy, target, argument, side_inputs)
  observer = _Observing(
    target,
    copy.capture_intermediates,
    side_inputs=side_inputs,
    building=False,
    prefix=copy.path,
  )
  apply_tree(copy, argument, random_streams, side_inputs, interceptor=observer)
  jax.effects_barrier()
  return tuple(
    _isolated(execution, observer.mutable, copy.capture_intermediates, side_inputs, number)
    for number, execution in enumerate(observer.executions)
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
      f"{node._where()} ran {len(found)} times in this call"
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
  mutable=False, **kwargs)`. NNX: `isolate(model, *args, at=..., method="__call__",
  **kwargs)`. The model is not modified.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    >>> x = jnp.ones((1, 3))
    >>> isolated = fl.isolate(model, model.init(jax.random.key(0), x), x, at="layers_2")
    >>> isolated.saved_arg.args[0].shape
    (1, 4)
  """
  from flaxlens._unflaxify import unflaxify

  options = {k: kwargs.pop(k) for k in ("method", "rngs", "mutable") if k in kwargs}
  tree = unflaxify(model, *args, **options, **kwargs)
  if isinstance(tree, InterceptedFlaxModuleMethod):
    args = args[1:]  # The variables.
  side = {"random_streams": options["rngs"]} if options.get("rngs") is not None else {}
  return isolate_submodel(
    tree.select().at_path(at), ArgsAndKwargs(args=args, kwargs=kwargs), **side
  )


def _concrete_streams(random_streams: Any) -> Any:
  """Draws the keys of `RandomStream`s now, so the run and its replay use the same."""
  from flaxlens.linen._tree import _resolve_rngs

  return _resolve_rngs(random_streams, "isolate_submodel")


def _isolated(
  execution: _Execution,
  mutable: tuple[str, ...],
  capture_intermediates: Any,
  side_inputs: dict[str, Any],
  number: int,
) -> IsolatedSubmodel:
  snapshot = RngSnapshot(
    keys=execution.keys,
    suffixes=tuple(sorted(execution.suffixes.items())),
    counters=execution.counters,
  )
  submodel, state = linen_submodel(
    execution.module,
    execution.method,
    execution.before,
    ArgsAndKwargs(args=execution.args, kwargs=execution.kwargs),
    snapshot,
    [c for c in mutable if c in execution.after or c in execution.before],
    capture_intermediates,
  )
  after = flatten_collections(execution.after)
  final = tuple(
    type(v)(value=after.get(_label_key(v.label), Uninitialized()), label=v.label) for v in state
  )
  return IsolatedSubmodel(
    submodel=submodel,
    saved_arg=ArgsAndKwargs(args=execution.args, kwargs=execution.kwargs),
    saved_side_inputs=dict(side_inputs),
    saved_output=execution.output,
    initial_var_values=state,
    final_var_values=final,
    call_number=number,
    recorded_compiled=execution.compiled,
  )


def linen_submodel(
  module: Any,
  method: Any,
  variables: dict[str, Any],
  argument: ArgsAndKwargs,
  rngs: Any,
  mutable: list[str],
  capture_intermediates: Any,
) -> tuple[InterceptedFlaxModuleMethod, tuple[Any, ...]]:
  """A Linen call as a submodel: converted on its own, parameters frozen, state unbound.

  `rngs` is the call's `RngSnapshot` (or, for a whole model, its `random_streams`).
  Returns the submodel and its state variables' initial values.
  """
  from flaxlens.linen._convert import unflaxify_linen

  tree = unflaxify_linen(
    module,
    variables,
    *argument.args,
    method=method,
    rngs=rngs,
    mutable=mutable,
    capture_intermediates=capture_intermediates,
    **argument.kwargs,
  )
  frozen = freeze_variables(tree, lambda v: isinstance(v, Parameter))
  return unbind_variables(frozen, freeze=True)


def _label_key(label: str) -> tuple[str, tuple[str, ...]]:
  collection, path = label.split(":", 1)
  return collection, split_name(path)


def _isolate_root(
  root: InterceptedFlaxModuleMethod,
  argument: ArgsAndKwargs,
  random_streams: Any,
  side_inputs: dict[str, Any],
) -> IsolatedSubmodel:
  frozen = freeze_variables(root, lambda v: isinstance(v, Parameter))
  submodel, state = unbind_variables(frozen, freeze=True)
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
