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

import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax

from flaxlens import _flax_internals as fi
from flaxlens._errors import CallStructureError, FlaxlensError, UnsupportedFlaxFeatureError
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._layer import Layer
from flaxlens.core._random import RandomStream
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._variables import (
  AbstractVariable,
  AbstractVariableSlot,
  AbstractVariableValue,
  StateVariable,
)

CallKey = tuple[int, str]
Path = tuple[str, ...]


class Uninitialized(Struct):
  """Value of a state variable that the model creates during its first call.

  It has no pytree leaves; the node's call creates the variable as Flax would and
  writes the new value into the `StateVariable`.
  """


class InterceptedFlaxScopeData(Struct):
  """A Flax module's own variables (not its children's), as seen by one call.

  Keys are names relative to the module (`"kernel"`); a variable of a submodule that
  never makes a call of its own is held by its nearest calling ancestor under its
  relative path (`"Dense_0/kernel"`).

  Attributes:
    parameters: the `params` collection, as `Parameter`s.
    variables: mutable collections, `{collection: {name: StateVariable}}`.
    immutable_variables: other collections, `{collection: {name: value}}`.
    rngs: rng streams the module drew keys from at conversion.
  """

  parameters: dict[str, Any]
  variables: dict[str, dict[str, Any]]
  immutable_variables: dict[str, dict[str, Any]]
  rngs: tuple[str, ...] = static_field(default=())


class InterceptedFlaxModuleMethod(Layer):
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
  """

  module: Any = static_field()
  method_name: Any = static_field()
  path: Path = static_field()
  scope_data: InterceptedFlaxScopeData
  submodule_calls: dict[CallKey, Any]
  capture_intermediates: Any = static_field(default=False)

  def readable_path(self) -> tuple[str, str]:
    """`("Block_0/Dense_0", "__call__")`: the module path and the method name."""
    name = self.method_name if isinstance(self.method_name, str) else _fn_name(self.method_name)
    return "/".join(self.path), name

  def _treescope_attributes(self) -> dict[str, Any]:
    attrs = self.attributes_dict()
    attrs["module"] = _ModuleSummary(self.module)
    return attrs

  def __call__(
    self,
    argument: ArgsAndKwargs,
    /,
    random_streams: Any = None,
    **side_inputs: Any,
  ) -> Any:
    if not isinstance(argument, ArgsAndKwargs):
      raise TypeError(
        f"{self._where()}: a converted call takes fl.ArgsAndKwargs.capture(*args,"
        f" **kwargs) as its argument, got {type(argument).__name__}."
      )
    state = _current_state()
    if state is not None and state.pending and state.pending[-1].matches(self):
      return state.continue_pending(self, argument)
    return _apply_tree(self, argument, random_streams, side_inputs)

  def _where(self) -> str:
    path, method = self.readable_path()
    return f"{path or type(self.module).__name__}.{method}"


class _ModuleSummary:
  """A one-line stand-in for a Flax module in treescope renderings."""

  def __init__(self, module: Any):
    self.module = module

  def __repr__(self) -> str:
    return f"{type(self.module).__name__}(name={self.module.name!r})"

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
    from treescope import rendering_parts

    return rendering_parts.text(repr(self))


def _fn_name(fn: Any) -> str:
  return getattr(fn, "__name__", type(fn).__name__)


# --- gathering variables from a tree ---------------------------------------------------


def _is_node(x: Any) -> bool:
  return isinstance(x, InterceptedFlaxModuleMethod)


def iter_nodes(tree: Any) -> list[InterceptedFlaxModuleMethod]:
  """All call nodes of `tree`, also those held inside replacement layers."""
  found: list[InterceptedFlaxModuleMethod] = []

  def visit(subtree: Any) -> None:
    for leaf in jax.tree_util.tree_leaves(subtree, is_leaf=_is_node):
      if _is_node(leaf):
        found.append(leaf)
        visit(leaf.submodule_calls)

  visit(tree)
  return found


def _value_of(entry: Any, where: str) -> Any:
  if isinstance(entry, AbstractVariable | AbstractVariableValue):
    return entry.value
  if isinstance(entry, AbstractVariableSlot):
    raise FlaxlensError(
      f"{where}: the variable {entry.label!r} is unbound (a slot). Bind it with"
      " fl.bind_variables(tree, values), or call the tree through stateless_call."
    )
  return entry


class _Gathered:
  """The variables dict for one apply, and where each mutable entry writes back."""

  def __init__(self) -> None:
    self.variables: dict[str, dict[str, Any]] = {}
    self.state: dict[tuple[str, Path], Any] = {}
    self._sources: dict[tuple[str, Path], Any] = {}

  def add(self, collection: str, path: Path, entry: Any, where: str) -> None:
    key = (collection, path)
    seen = self._sources.get(key)
    if seen is not None:
      if seen is not entry:
        raise FlaxlensError(
          f"{where}: two calls of the module hold different values for"
          f" {collection}:{'/'.join(path)}. Calls of one module share their variables;"
          " edit the shared Parameter's .value instead of replacing it in one call."
        )
      return
    self._sources[key] = entry
    if isinstance(entry, StateVariable):
      self.state[key] = entry
    value = _value_of(entry, where)
    if isinstance(value, Uninitialized):
      return
    target = self.variables.setdefault(collection, {})
    for name in path[:-1]:
      target = target.setdefault(name, {})
    target[path[-1]] = value


def _gather(root: InterceptedFlaxModuleMethod) -> _Gathered:
  gathered = _Gathered()
  prefix = root.path
  for node in iter_nodes(root):
    if node.path[: len(prefix)] != prefix:
      raise UnsupportedFlaxFeatureError(
        f"{root._where()}: this call uses the module at {'/'.join(node.path)!r}, which"
        " lives outside it; call the enclosing tree instead."
      )
    base = node.path[len(prefix) :]
    where = node._where()
    data = node.scope_data
    for name, entry in data.parameters.items():
      gathered.add("params", base + tuple(name.split("/")), entry, where)
    for group in (data.variables, data.immutable_variables):
      for collection, entries in group.items():
        for name, entry in entries.items():
          gathered.add(collection, base + tuple(name.split("/")), entry, where)
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
      raise TypeError(
        f"{where}: random_streams[{name!r}] must be a JAX key or an fl.RandomStream,"
        f" got {type(stream).__name__}."
      )
  return keys


def _apply_tree(
  root: InterceptedFlaxModuleMethod,
  argument: ArgsAndKwargs,
  random_streams: Any,
  side_inputs: dict[str, Any],
) -> Any:
  where = root._where()
  gathered = _gather(root)
  mutable = tuple(sorted({collection for collection, _ in gathered.state}))
  rngs = _resolve_rngs(random_streams, where)
  state = _ApplyState(side_inputs=side_inputs, building=False, prefix=root.path)
  method = root.method_name
  state.frames.append(
    _Frame(path=root.path, node=root, absorb=method if isinstance(method, str) else None)
  )
  with state.active():
    result = fi.apply_fresh(
      root.module,
      gathered.variables,
      *argument.args,
      method=method,
      rngs=rngs,
      mutable=list(mutable) if mutable else False,
      capture_intermediates=root.capture_intermediates,
      **argument.kwargs,
    )
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
    names = [f"{c}:{'/'.join(p)}" for c, p in unknown[:6]]
    raise CallStructureError(
      f"{root._where()}: this call created variables that did not exist at conversion:"
      f" {names}. Convert with example arguments that create them (for example the"
      " same flags), so the tree has state variables to hold them."
    )
  for key, value in flat.items():
    gathered.state[key].value = value


# --- the interceptor -------------------------------------------------------------------


class _Frame:
  """One active call: where submodule calls made inside it are looked up or recorded."""

  __slots__ = ("path", "node", "record", "counter", "absorb", "lifted")

  def __init__(self, path: Path, node: Any = None, record: Any = None, absorb: Any = None):
    self.path = path
    self.node = node
    self.record = record
    self.counter = 0
    self.absorb = absorb
    # After Flax's setup check of a lifted module: [call name, index] of the lifted
    # call, so that a transform tracing its body again (nn.scan traces twice) reuses
    # the same call index, and so the same node.
    self.lifted: list[Any] | None = None

  def next_key(self, name: str) -> tuple[CallKey, bool]:
    """The key of the next call named `name`, and whether it re-traces the last one."""
    lifted = self.lifted
    if lifted is not None and lifted[0] == name:
      return (lifted[1], name), True
    index = self.counter
    self.counter += 1
    if lifted is not None and lifted[0] is None:
      lifted[0], lifted[1] = name, index
    else:
      self.lifted = None
    return (index, name), False


class _Pending:
  """A replaced call whose replacement may continue the original natively."""

  __slots__ = ("path", "method_name", "next_fun")

  def __init__(self, path: Path, method_name: str, next_fun: Callable[..., Any]):
    self.path = path
    self.method_name = method_name
    self.next_fun = next_fun

  def matches(self, node: InterceptedFlaxModuleMethod) -> bool:
    return node.path == self.path and node.method_name == self.method_name


class CallRecord:
  """What conversion saw of one call (made into a node afterwards)."""

  __slots__ = ("module", "path", "method_name", "children", "rngs")

  def __init__(self, module: Any, path: Path, method_name: Any):
    self.module = module
    self.path = path
    self.method_name = method_name
    self.children: list[tuple[CallKey, CallRecord]] = []
    self.rngs: tuple[str, ...] = ()


_local = threading.local()


def _current_state() -> _ApplyState | None:
  stack = getattr(_local, "stack", None)
  return stack[-1] if stack else None


def _relative_name(frame_path: Path, path: Path) -> str:
  if path == frame_path:
    return "self"
  if path[: len(frame_path)] == frame_path:
    return "/".join(path[len(frame_path) :])
  return "/" + "/".join(path)


def _pristine(node: InterceptedFlaxModuleMethod) -> bool:
  return all(_is_node(child) and _pristine(child) for child in node.submodule_calls.values())


class _ApplyState:
  """Interception state of one running `apply` (conversion or call)."""

  def __init__(self, side_inputs: dict[str, Any], building: bool, prefix: Path = ()):
    self.side_inputs = side_inputs
    self.building = building
    self.prefix = prefix
    self.frames: list[_Frame] = []
    self.pending: list[_Pending] = []

  def active(self) -> Any:
    state = self

    class _Active:
      def __enter__(self) -> None:
        if not hasattr(_local, "stack"):
          _local.stack = []
        _local.stack.append(state)
        self._interceptor = fi.intercept_methods(state.intercept)
        self._interceptor.__enter__()

      def __exit__(self, *exc: Any) -> None:
        try:
          self._interceptor.__exit__(*exc)
        finally:
          _local.stack.remove(state)

    return _Active()

  def run_frame(self, frame: _Frame, fun: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    self.frames.append(frame)
    try:
      return fun(*args, **kwargs)
    finally:
      self.frames.pop()

  def continue_pending(self, node: InterceptedFlaxModuleMethod, argument: ArgsAndKwargs) -> Any:
    pending = self.pending.pop()
    try:
      return self.run_frame(
        _Frame(node.path, node=node), pending.next_fun, argument.args, argument.kwargs
      )
    finally:
      self.pending.append(pending)

  def intercept(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    if _current_state() is not self or context.method_name == "setup":
      return next_fun(*args, **kwargs)
    frame = self.frames[-1]
    module = context.module
    if fi.is_setup_check(module):
      frame.lifted = [None, None]
      return next_fun(*args, **kwargs)
    path = self.prefix + fi.module_path(module)
    name = context.method_name
    if frame.absorb is not None and path == frame.path and name == frame.absorb:
      frame.absorb = None
      return next_fun(*args, **kwargs)
    key, retrace = frame.next_key(f"{_relative_name(frame.path, path)}.{name}")
    if self.building:
      return self._record(frame, key, retrace, module, path, name, next_fun, args, kwargs)
    if frame.node is None:
      return self.run_frame(_Frame(path), next_fun, args, kwargs)
    child = frame.node.submodule_calls.get(key)
    if _is_node(child) and child.path == path and type(child.module) is type(module):
      return self.run_frame(_Frame(path, node=child), next_fun, args, kwargs)
    if child is None or _is_node(child):
      self._diverged(frame, key)
      return self.run_frame(_Frame(path), next_fun, args, kwargs)
    self.pending.append(_Pending(path, name, next_fun))
    try:
      return child(ArgsAndKwargs(args=tuple(args), kwargs=dict(kwargs)), **self.side_inputs)
    finally:
      self.pending.pop()

  def _diverged(self, frame: _Frame, key: CallKey) -> None:
    node = frame.node
    if not _pristine(node):
      seen = list(node.submodule_calls)
      raise CallStructureError(
        f"{node._where()}: call {key} was not made at conversion (conversion saw"
        f" {seen[:8]}), and this part of the tree has replaced calls that would no"
        " longer line up. Convert with example arguments that take the same branch."
      )
    frame.node = None

  def _record(self, frame, key, retrace, module, path, name, next_fun, args, kwargs) -> Any:
    record = CallRecord(fi.unbound_clone(module), path, name)
    if not retrace:
      frame.record.children.append((key, record))
    before = fi.rng_counts(module)
    try:
      return self.run_frame(_Frame(path, record=record), next_fun, args, kwargs)
    finally:
      after = fi.rng_counts(module)
      record.rngs = tuple(sorted(k for k, v in after.items() if v > before.get(k, 0)))
