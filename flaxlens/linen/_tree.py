"""The Linen call tree: one `InterceptedFlaxModuleMethod` node per intercepted call.

Calling a node runs the node's Flax module with `module.apply` once, natively, under a
method interceptor. Each submodule call Flax makes is matched to the node's
`submodule_calls` entry by `(call_index, "Child.method")`: an unmodified node lets the
call continue natively (so rng derivation, lifted transforms and mutable collections
are Flax's own, bit for bit); any other layer replaces the call and receives its
`ArgsAndKwargs`. A replacement that calls the original node it wraps continues the
native call at that point. Per-node re-application (Penzai's design) was rejected: it
changes rng derivation and cannot run inside `nn.scan`/`nn.vmap` bodies.

Variables are gathered from every node of the tree by their absolute module path and
passed to the one `apply`; updated mutable collections are written back into the
tree's `StateVariable`s. Flax internals used: see `flaxlens._flax_internals`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import flax.linen as nn
import jax
from flax import errors as flax_errors

from flaxlens import _flax_internals as fi
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._calls import (
  CallInterceptor,
  CallNode,
  CallRecord,
  CallSpec,
  Frame,
  Path,
  current_interceptor,
  own_call_nodes,
)
from flaxlens.core._inner_jit import RunToken
from flaxlens.core._names import join_name, split_name
from flaxlens.core._random import RandomStream
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._variables import (
  StateVariable,
  Uninitialized,
  check_storable,
  private_value,
  same_entry,
  value_of,
)
from flaxlens.errors import (
  ArgumentError,
  CallStructureError,
  FlaxlensError,
  UnsupportedFlaxFeatureError,
)


class InterceptedFlaxScopeData(Struct):
  """A Flax module's own variables (not its children's), as seen by one call.

  Keys are names relative to the module (`"kernel"`); a variable of a submodule that
  never makes a call of its own is held by its nearest calling ancestor under its
  relative path (`"Dense_0/kernel"`). Names are paths of keys joined by "/", with "~"
  and "/" inside a key written "~0" and "~1" (RFC 6901), so a Flax name that contains
  "/" stays one key: `nn.WeightNorm`'s `"Dense_0/kernel/scale"` reads
  `"Dense_0~1kernel~1scale"`. Labels read `"collection:path"`, spelled the same way.

  Attributes:
    parameters: the `params` collection, as `Parameter`s.
    variables: mutable collections, `{collection: {name: StateVariable}}`.
    immutable_variables: other collections, `{collection: {name: value}}`.
    rngs: None when the call takes its keys from the enclosing call (as every call of a
      converted tree does); an `RngSnapshot` when it was cut out of a larger model, so
      that on its own it draws the keys it drew there.
  """

  parameters: dict[str, Any]
  variables: dict[str, dict[str, Any]]
  immutable_variables: dict[str, dict[str, Any]]
  rngs: Any = None


class RngSnapshot(Struct):
  """The rng state a Flax scope had when a call started: keys, suffixes and counters.

  Attributes:
    keys: the stream keys, `{stream: key}`.
    suffixes: per stream, the names Flax folds into its key lazily.
    counters: the scope's draw counters, including those of child scopes.
  """

  keys: dict[str, Any]
  suffixes: tuple[tuple[str, tuple[Any, ...]], ...] = static_field()
  counters: Any = static_field()

  def as_flax(self) -> tuple[dict[str, Any], dict[str, tuple], dict]:
    return dict(self.keys), dict(self.suffixes), self.counters


class InterceptedFlaxModuleMethod(CallNode):
  """One call of a Flax Linen module method, with its submodule calls as children.

  Call it as `node(fl.ArgsAndKwargs.capture(*args, **kwargs), random_streams=...)`;
  `random_streams` maps stream names to JAX keys or `fl.RandomStream`s (a single key is
  taken as Flax takes `rngs=key`). Every other keyword is a side input passed to
  replacement layers.

  Attributes:
    module: the unbound Flax module.
    method_name: the method called (a string, or the function given as `method=`).
    path: the module's scope path in the converted model.
    scope_data: the module's own variables.
    submodule_calls: `{(call_index, "Child.method"): layer}` in call order.
    capture_intermediates: Flax's `capture_intermediates` option for this apply.
    mutable: the collections the apply treats as mutable (besides those holding
      state variables), from the `mutable=` given at conversion.
    lifted_by: the lifted transforms (`"scan"`, `"vmap"`, ...) the call runs inside.
    converted_module: the module as conversion recorded it. Settings in which `module`
      differs from it (`module.clone(dtype=jnp.bfloat16)`) apply when the tree runs.
    call_specs: what conversion saw of each submodule call (arguments and output,
      abstractly); replacement outputs are checked against it.
    origin: the id of the conversion that made the node; a replacement continues a
      call natively only through a node of the same conversion.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.Dropout(0.5, deterministic=False)])
    >>> x, rngs = jnp.ones((1, 3)), {"dropout": jax.random.key(1)}
    >>> variables = model.init(jax.random.key(0), x)
    >>> tree = fl.unflaxify(model, variables, x, rngs=rngs)
    >>> out = tree(fl.ArgsAndKwargs.capture(x), random_streams=rngs)
    >>> bool((out == model.apply(variables, x, rngs=rngs)).all())
    True
  """

  module: Any = static_field()
  method_name: Any = static_field()
  path: Path = static_field()
  scope_data: InterceptedFlaxScopeData
  submodule_calls: dict[tuple[int, str], Any]
  capture_intermediates: Any = static_field(default=False)
  mutable: tuple[str, ...] = static_field(default=())
  lifted_by: tuple[str, ...] = static_field(default=())
  converted_module: Any = static_field(default=None)
  call_specs: tuple[CallSpec, ...] = static_field(default=())
  origin: int = static_field(default=0)

  treescope_hidden_fields = ("converted_module", "call_specs", "origin")
  treescope_short_fields = ("module",)

  def _module_type_name(self) -> str:
    return type(self.module).__name__

  def flax_variables(self) -> dict[str, Any]:
    """The variables of this call's module as a Flax variables dict, edits included.

    `node.module.apply(node.flax_variables(), ...)` runs the module natively with the
    tree's current parameters and state (variables not created yet are left out).

    Example:
      >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
      >>> model, x = nn.Dense(2), jnp.ones((1, 3))
      >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
      >>> tree.scope_data.parameters["bias"].value += 1.0
      >>> tree.flax_variables()["params"]["bias"]
      Array([1., 1.], dtype=float32)
    """
    return _gather(self).variables

  def _run_root(
    self, argument: ArgsAndKwargs, /, random_streams: Any = None, **side_inputs: Any
  ) -> Any:
    return apply_tree(self, argument, random_streams, side_inputs)


# --- gathering variables from a tree ---------------------------------------------------


class _Gathered:
  """The variables dict for one apply, and where each mutable entry writes back."""

  def __init__(self) -> None:
    self.variables: dict[str, dict[str, Any]] = {}
    self.state: dict[tuple[str, Path], Any] = {}
    self._sources: dict[tuple[str, Path], Any] = {}

  def sources(self) -> list[Any]:
    """The gathered entries (variables and values), each once."""
    return list(self._sources.values())

  def add(self, collection: str, path: Path, entry: Any, where: str) -> None:
    key = (collection, path)
    seen = self._sources.get(key)
    if seen is not None:
      if not same_entry(seen, entry):
        raise FlaxlensError(
          f"{where}: two calls of the module hold different values for"
          f" {collection}:{join_name(path)}. Calls of one module share their variables;"
          " edit the shared Parameter's .value instead of replacing it in one call."
        )
      return
    self._sources[key] = entry
    if isinstance(entry, StateVariable):
      self.state[key] = entry
    value = value_of(entry, where)
    if isinstance(value, Uninitialized):
      return
    target = self.variables.setdefault(collection, {})
    for name in path[:-1]:
      target = target.setdefault(name, {})
    target[path[-1]] = private_value(value)


def _gather(root: InterceptedFlaxModuleMethod) -> _Gathered:
  gathered = _Gathered()
  prefix = root.path
  for node in own_call_nodes(root):
    if node.path[: len(prefix)] != prefix:
      raise UnsupportedFlaxFeatureError(
        f"{root._where()}: this call uses the module at {'/'.join(node.path)!r}, which"
        " lives outside it; call the enclosing tree instead."
      )
    base = node.path[len(prefix) :]
    where = node._where()
    data = node.scope_data
    for name, entry in data.parameters.items():
      gathered.add("params", base + split_name(name), entry, where)
    for group in (data.variables, data.immutable_variables):
      for collection, entries in group.items():
        for name, entry in entries.items():
          gathered.add(collection, base + split_name(name), entry, where)
  return gathered


def flatten_collections(collections: Mapping[str, Any]) -> dict[tuple[str, Path], Any]:
  """`{collection: nested dict}` -> `{(collection, path): leaf}`; mappings are nodes."""
  flat: dict[tuple[str, Path], Any] = {}

  def walk(collection: str, value: Any, path: Path) -> None:
    if isinstance(value, Mapping):
      for name, child in value.items():
        walk(collection, child, path + (name,))
    else:
      flat[(collection, path)] = value

  for collection, tree in collections.items():
    walk(collection, tree, ())
  return flat


# --- running a tree --------------------------------------------------------------------


_SHAPE_PRESERVING_LIFTS = ("jit", "remat", "checkpoint", "named_call")


def _resolve_rngs(random_streams: Any, where: str) -> Any:
  if random_streams is None:
    return None
  if not isinstance(random_streams, Mapping):
    return random_streams
  keys = {}
  for name, stream in random_streams.items():
    if isinstance(stream, RandomStream):
      keys[name] = stream.next_key()
    elif isinstance(stream, jax.Array):
      keys[name] = stream
    else:
      raise ArgumentError(
        f"{where}: random_streams[{name!r}] must be a JAX key or an fl.RandomStream,"
        f" got {type(stream).__name__}."
      )
  return keys


def apply_tree(
  root: InterceptedFlaxModuleMethod,
  argument: ArgsAndKwargs,
  random_streams: Any,
  side_inputs: dict[str, Any],
  interceptor: LinenInterceptor | None = None,
) -> Any:
  """Runs `root` natively under `interceptor` (a plain `LinenInterceptor` if None)."""
  where = root._where()
  batched = [t for t in root.lifted_by if t not in _SHAPE_PRESERVING_LIFTS]
  if batched:
    raise UnsupportedFlaxFeatureError(
      f"{where}: this call runs inside nn.{batched[-1]}, where its variables are"
      " sliced per iteration, so it cannot be called on its own. Call the tree it"
      " belongs to (patches inside it apply at every iteration)."
    )
  gathered = _gather(root)
  mutable = tuple(sorted({c for c, _ in gathered.state}.union(root.mutable)))
  rngs = _resolve_rngs(random_streams, where)
  snapshot = root.scope_data.rngs if random_streams is None else None
  state = interceptor
  if state is None:
    state = LinenInterceptor(side_inputs, building=False, prefix=root.path)
    traced = frozenset(id(e) for e in gathered.sources())
    state.token = RunToken(state, (root, side_inputs), traced)
  state.mutable = mutable
  capture = state.capture_only_native(fi.capture_filter(root.capture_intermediates))
  method = root.method_name
  frame = Frame(path=root.path, node=root, absorb=method if isinstance(method, str) else None)
  state.frames.append(frame)
  with state.active():
    result = fi.apply_fresh(
      root.module,
      gathered.variables,
      *argument.args,
      method=method,
      rngs=rngs,
      mutable=list(mutable) if mutable else False,
      capture_intermediates=capture,
      rng_snapshot=snapshot.as_flax() if snapshot is not None else None,
      **argument.kwargs,
    )
  state.check_reached(frame)
  if not mutable:
    return result
  output, updates = result
  _write_back(root, gathered, updates)
  return output


def _write_back(
  root: InterceptedFlaxModuleMethod, gathered: _Gathered, updates: Mapping[str, Any]
) -> None:
  flat = flatten_collections(updates)
  unknown = [k for k in flat if k not in gathered.state]
  if unknown:
    names = [f"{c}:{join_name(p)}" for c, p in unknown[:6]]
    raise CallStructureError(
      f"{root._where()}: this call created variables that did not exist at conversion:"
      f" {names}. Convert with example arguments that create them (for example the"
      " same flags), so the tree has state variables to hold them."
    )
  where = root._where()
  for key, value in flat.items():
    check_storable(gathered.state[key], value, where)
  for key, value in flat.items():
    gathered.state[key].value = value


# --- the interceptor -------------------------------------------------------------------

# Flax's errors for a module whose variables differ from those it is given.
_UNFIT_EDIT = (
  flax_errors.ScopeParamNotFoundError,
  flax_errors.ScopeParamShapeError,
  flax_errors.ScopeCollectionNotFound,
  flax_errors.ScopeVariableNotFoundError,
)


class LinenInterceptor(CallInterceptor):
  """Receives Linen's method-interceptor callbacks for one `apply`.

  Flax captures a call's output for `capture_intermediates` after the interceptors
  return. A call whose replacement never ran the original has no node (and so no
  state variable) in the tree to hold it; the capture filter made by
  `capture_only_native` leaves such a call out, so its intermediates are absent.
  """

  mutable: tuple[str, ...] = ()
  _not_run: tuple[Any, str] | None = None  # The last call that did not run natively.

  def intercept(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    if current_interceptor() is not self or context.method_name == "setup":
      return next_fun(*args, **kwargs)
    module = context.module
    if fi.is_setup_check(module):
      self.frames[-1].lifted = [None, None]
      return next_fun(*args, **kwargs)
    path = self.prefix + fi.module_path(module)
    ran = []

    def native(*a: Any, **k: Any) -> Any:
      ran.append(True)
      return next_fun(*a, **k)

    output = self.dispatch(module, path, context.method_name, native, args, kwargs)
    self._not_run = None if ran else (module, context.method_name)
    return output

  def capture_only_native(
    self, capture: Callable[[Any, str], bool] | None
  ) -> Callable[[Any, str], bool] | None:
    """`capture` (a `capture_intermediates` filter) minus calls that did not run natively."""
    if capture is None:
      return None

    def only_native(module: Any, method_name: str) -> bool:
      not_run, self._not_run = self._not_run, None
      if not_run is not None and not_run[0] is module and not_run[1] == method_name:
        return False
      return capture(module, method_name)

    return only_native

  @contextmanager
  def active(self) -> Iterator[None]:
    opened: list[Any] = []

    def start() -> Any:
      context = self.inner_jit(fi.current_trace())
      key = context.__enter__()
      opened.append(context)
      return key

    def finish() -> None:
      opened.pop().__exit__(None, None, None)

    with (
      super().active(),
      fi.intercept_methods(self.intercept),
      fi.linen_jit_keys(start, finish),
    ):
      yield

  def new_record(self, module: Any, path: Path, name: str) -> CallRecord:
    return CallRecord(fi.unbound_clone(module), path, name)

  def same_module(self, node: CallNode, module: Any) -> bool:
    return type(node.module) is type(module)

  def run_node(
    self, node: CallNode, module: Any, next_fun: Callable[..., Any], args: Any, kwargs: Any
  ) -> Any:
    """Runs `node`'s call natively, with the settings edited in `node.module` applied.

    The settings (dataclass fields) in which `node.module` differs from the module
    conversion recorded are set on the model's own module for the duration of the
    call, so the call runs as in a model built with them: same variables, rngs and
    submodule calls.
    """
    fields = self.edited_fields(node, module)
    if not fields:
      return super().run_node(node, module, next_fun, args, kwargs)
    with fi.fields_set(module, fields):
      try:
        return super().run_node(node, module, next_fun, args, kwargs)
      except _UNFIT_EDIT as e:
        raise FlaxlensError(
          f"{node._where()}: the edited settings {sorted(fields)} do not fit the variables"
          f" the tree holds for this call ({type(e).__name__}: {str(e).splitlines()[0]})."
          " Edit settings that keep the module's variables (dtype, precision, ...), or"
          " convert a model built with the new settings."
        ) from e

  def edited_fields(self, node: CallNode, module: Any) -> dict[str, Any]:
    """The settings edited in `node.module`, to set on the model's `module` ({} if none).

    Raises:
      FlaxlensError: for an edit that cannot apply (another class or name, another
        submodule, or any setting of a module with `setup`, which runs first).
    """
    where, recorded = node._where(), node.converted_module
    if node.module is recorded or recorded is None:
      return {}
    if type(node.module) is not type(recorded) or node.module.name != recorded.name:
      raise FlaxlensError(
        f"{where}: the node's module was replaced by a {type(node.module).__name__} named"
        f" {node.module.name!r}; a node's module can only change its settings"
        " (module.clone(dtype=...)). To run other code here, replace the call with a layer."
      )
    fields = fi.changed_fields(node.module, recorded)
    held = [n for n, v in fields.items() if isinstance(v, nn.Module)]
    if held or (fields and fi.defines_setup(module)):
      what = f"the submodules {held}" if held else "settings of a module with setup()"
      raise FlaxlensError(
        f"{where}: the edit changes {what}, which Flax has used before the call starts"
        " (setup runs first). Edit settings of modules without setup, such as the"
        " submodules' own nodes, or convert a model built with the new settings."
      )
    return fields

  def record_call(self, record: CallRecord, module: Any, run: Callable[[], Any]) -> Any:
    record.extra["lifted_by"] = fi.lifting_transforms(module)
    return super().record_call(record, module, run)
