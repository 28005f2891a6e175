"""What Linen and NNX call trees share: call nodes and the dispatch of intercepted calls.

A converted model is run natively once per call of its root node; a framework hook
(Linen's method interceptor, NNX's instrumented classes) reports every submodule call to
a `CallInterceptor`. The interceptor keeps a stack of frames, one per active call, and
names each submodule call `(call_index, "Child.method")` within its caller. While
converting it records the calls; while running a tree it looks each call up in the
caller node's `submodule_calls`: a call node continues natively, any other layer replaces
the call (and may continue it natively by calling the node it wraps). No Flax internals.

Rules of the dispatch, each enforced here for both frameworks:
- A node continues a replaced call only if it comes from the same conversion (`origin`)
  and stands for the same module path and method; any other node (of another tree, or
  another call of this one) called inside a replacement runs as a tree of its own.
- A replaced call must be reached: a frame that ends without making a call whose entry
  was replaced raises `CallStructureError` (unreplaced calls may be skipped freely).
- An entry cannot be removed (None, or deleted from `submodule_calls`); a replacement
  must be callable, and its output must have the structure, dtype and shape the
  replaced call had at conversion for the same kind of arguments (`CallSpec.check`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import numpy as np

from flaxlens._errors import (
  ArgumentError,
  CallStructureError,
  FlaxlensError,
  ReplacementError,
  UnsupportedFlaxFeatureError,
)
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._inner_jit import RunToken, inner_jit
from flaxlens.core._layer import Layer

CallKey = tuple[int, str]
Path = tuple[Any, ...]


class CallNode(Layer):
  """Base class of converted calls: one node per call a Flax module made.

  A node is called as `node(fl.ArgsAndKwargs.capture(*args, **kwargs), **side_inputs)`
  and runs its call natively; `submodule_calls` holds the calls made inside it, each a
  node or a replacement layer. Every node, Linen or NNX, has these fields:

  Attributes:
    module_type: the class of the Flax module whose method the node calls.
    method_name: the method called (a string, or the function given as `method=`).
    path: the module's path in the converted model.
    scope_data: the module's own variables (an `InterceptedFlaxScopeData`).
    submodule_calls: `{(call_index, "Child.method"): layer}` in call order.
    sliced: whether the call runs inside a lifted transform that slices its variables
      per iteration (`nn.scan`, `nn.vmap`, `nnx.scan`, `nnx.vmap`); such a call runs
      only as part of its tree.
    call_specs: what conversion saw of each submodule call (one `CallSpec` each).
    origin: an id shared by the nodes of one conversion.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> isinstance(tree, fl.CallNode), tree.module_type.__name__, tree.where()
    (True, 'Dense', 'Dense.__call__')
  """

  def readable_path(self) -> tuple[str, str]:
    """`("Block_0/Dense_0", "__call__")`: the module path and the method name."""
    name = self.method_name
    if not isinstance(name, str):
      name = getattr(name, "__name__", type(name).__name__)
    return "/".join(str(p) for p in self.path), name

  def where(self) -> str:
    """`"Block_0/Dense_0.__call__"`: how messages name this call."""
    path, method = self.readable_path()
    return f"{path or self.module_type.__name__}.{method}"

  def check_runs_alone(self, cannot: str) -> None:
    """Refuses an operation a sliced call cannot do; `cannot` completes the message."""
    if self.sliced:
      raise UnsupportedFlaxFeatureError(
        f"{self.where()}: this call runs inside a lifted transform that slices its"
        f" variables per iteration (nn.scan, nn.vmap, nnx.scan, nnx.vmap), so it cannot"
        f" {cannot}."
      )

  def __call__(self, argument: ArgsAndKwargs, /, **side_inputs: Any) -> Any:
    if not isinstance(argument, ArgsAndKwargs):
      raise ArgumentError(
        f"{self.where()}: a converted call takes fl.ArgsAndKwargs.capture(*args,"
        f" **kwargs) as its argument, got {type(argument).__name__}."
      )
    interceptor = current_interceptor()
    if interceptor is not None and interceptor.pending and interceptor.pending[-1].matches(self):
      return interceptor.continue_pending(self, argument)
    return self._run_root(argument, **side_inputs)

  def _run_root(self, argument: ArgsAndKwargs, /, **side_inputs: Any) -> Any:
    """Runs this node as the root of a run (its framework's node type implements it)."""
    raise NotImplementedError

  def _call_spec(self, key: CallKey) -> CallSpec | None:
    """What conversion saw of the submodule call `key` (None if it did not see it)."""
    specs = self.__dict__.get("_flaxlens_specs")
    if specs is None:
      specs = {spec.key: spec for spec in self.call_specs}
      object.__setattr__(self, "_flaxlens_specs", specs)
    return specs.get(key)

  def _describe(self, key: CallKey) -> str:
    return f"{self.where()}: call {key!r}"


_origins = itertools.count(1)


def new_origin() -> int:
  """A fresh id for the nodes of one conversion (0 is left for hand-built nodes)."""
  return next(_origins)


def is_call_node(x: Any) -> bool:
  return isinstance(x, CallNode)


def iter_call_nodes(tree: Any) -> Iterator[CallNode]:
  """All call nodes of `tree`, parents first, also those inside replacement layers."""
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_call_node):
    if is_call_node(leaf):
      yield leaf
      yield from iter_call_nodes(leaf.submodule_calls)


def _outer_call_nodes(tree: Any) -> Iterator[CallNode]:
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_call_node):
    if is_call_node(leaf):
      yield leaf


def own_call_nodes(root: CallNode) -> Iterator[CallNode]:
  """The nodes whose variables a run of `root` uses, parents first.

  These are `root`, its call-node children of the same conversion, and inside each
  replacement layer the nodes that continue the replaced call (same conversion, same
  module path and method). Other nodes held by replacement layers (of another tree, or
  of another call of this one) run as trees of their own and keep their variables.
  """
  yield root
  for key, child in root.submodule_calls.items():
    if is_call_node(child) and child.origin == root.origin:
      yield from own_call_nodes(child)
      continue
    spec = root._call_spec(key)
    for node in _outer_call_nodes(child):
      if node.origin == root.origin and (spec is None or spec.continued_by(node)):
        yield from own_call_nodes(node)


def pristine(node: CallNode) -> bool:
  """Whether no call under `node` has been replaced (by a layer or another tree's node)."""
  return all(
    is_call_node(c) and c.origin == node.origin and pristine(c)
    for c in node.submodule_calls.values()
  )


class _Opaque:
  """Stands for a non-array leaf that cannot be compared by value: only its type counts."""

  __slots__ = ("type",)

  def __init__(self, leaf_type: type):
    self.type = leaf_type

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Opaque) and other.type is self.type

  def __hash__(self) -> int:
    return hash(self.type)

  def __repr__(self) -> str:
    return f"<{self.type.__name__}>"


_PLAIN = (str, int, float, bool, complex, type(None))


def _summary(leaf: Any) -> Any:
  if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
    return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
  if type(leaf) in _PLAIN:
    return leaf
  return _Opaque(type(leaf))


def _signature(tree: Any) -> tuple[Any, tuple[Any, ...]] | None:
  """`(treedef, leaf summaries)`: arrays as `ShapeDtypeStruct`s, plain values as is."""
  try:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
  except Exception:  # A pytree that cannot be flattened outside its context.
    return None
  return treedef, tuple(_summary(x) for x in leaves)


def _show(summary: Any) -> str:
  if isinstance(summary, jax.ShapeDtypeStruct):
    return f"{summary.dtype}{list(summary.shape)}"
  return repr(summary)


def _show_signature(signature: tuple[Any, tuple[Any, ...]]) -> str:
  treedef, leaves = signature
  shown = jax.tree_util.tree_unflatten(treedef, [_Shown(_show(x)) for x in leaves])
  return repr(shown)


class _Shown:
  __slots__ = ("text",)

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


class CallSpec:
  """What conversion saw of one submodule call: its module, arguments and output.

  Arrays are kept abstractly (`jax.ShapeDtypeStruct`), so recording costs nothing;
  inside `nn.scan`/`nn.vmap`/`nnx.vmap` bodies these are the per-iteration values the
  body sees, as replacements there see them.

  Attributes:
    key: the call's key in its caller's `submodule_calls`.
    path: the called module's path.
    method_name: the called method.
    inputs: `(treedef, leaf summaries)` of `(args, kwargs)` at conversion.
    output: `(treedef, leaf summaries)` of the call's output at conversion.
  """

  __slots__ = ("key", "path", "method_name", "inputs", "output", "_hash")

  def __init__(
    self, key: CallKey, path: Path, method_name: Any, args: Any, kwargs: Any, output: Any
  ):
    self.key = key
    self.path = path
    self.method_name = method_name
    self.inputs = _signature((tuple(args), dict(kwargs)))
    self.output = _signature(output)
    try:
      self._hash = hash((key, path, self.inputs, self.output))
    except TypeError:  # Unhashable static data in a treedef: hash the call alone.
      self._hash = hash((key, path))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    return self is other or (
      type(other) is CallSpec
      and self._hash == other._hash
      and _same_static(
        (self.key, self.path, self.inputs, self.output),
        (other.key, other.path, other.inputs, other.output),
      )
    )

  def __repr__(self) -> str:
    return f"CallSpec({self.key!r})"

  def continued_by(self, node: CallNode) -> bool:
    """Whether `node` stands for this call's module and method (its origin aside)."""
    return node.path == self.path and node.method_name == self.method_name

  def check(self, output: Any, args: Any, kwargs: Any) -> str | None:
    """What is wrong with `output` as this call's output for these arguments, or None.

    The rule: the output must be what the original call would return for these
    arguments, as far as conversion tells without running it again. The call's output
    depends on its arguments only through their structure, static (non-array) values,
    dtypes and shapes; so
    - if the arguments have the structure and static values seen at conversion, the
      output must have the structure seen at conversion;
    - if their arrays also have the dtypes and ranks seen at conversion, each output
      array must have the dtype (weak types aside) and rank seen at conversion;
    - if their arrays also have the very shapes seen at conversion, each output array
      must have the very shape seen at conversion.
    A call made with other kinds of arguments (another batch size, another flag) is
    checked only as far as its arguments agree, so legitimate call-time differences
    are never refused. (A call whose output shape depends on array *values* or on
    edited parameter shapes or dtypes is out of reach of the rule; flaxlens assumes it
    does not happen.)
    """
    if self.inputs is None or self.output is None:
      return None
    given = _signature((tuple(args), dict(kwargs)))
    if given is None or not _same_static(given[0], self.inputs[0]):
      return None
    arrays = []
    for a, b in zip(given[1], self.inputs[1], strict=True):
      if isinstance(a, jax.ShapeDtypeStruct) or isinstance(b, jax.ShapeDtypeStruct):
        arrays.append((a, b))
      elif not _same_static(a, b):
        return None
    same_kind = all(
      isinstance(a, jax.ShapeDtypeStruct)
      and isinstance(b, jax.ShapeDtypeStruct)
      and a.dtype == b.dtype
      and len(a.shape) == len(b.shape)
      for a, b in arrays
    )
    same_shapes = same_kind and all(a.shape == b.shape for a, b in arrays)
    leaves, treedef = jax.tree_util.tree_flatten(output)

    def got() -> str:
      return _show_signature((treedef, tuple(_summary(x) for x in leaves)))

    if not _same_static(treedef, self.output[0]):
      return f"{got()}, where the call returns {_show_signature(self.output)} (another structure)"
    for leaf, want in zip(leaves, self.output[1], strict=True):
      if not isinstance(want, jax.ShapeDtypeStruct) or not same_kind:
        continue
      shape, dtype, weak = _leaf_type(leaf)
      wrong = len(shape) != len(want.shape) or (same_shapes and shape != want.shape)
      if wrong or (not weak and dtype != want.dtype):
        expected = _show_signature(self.output)
        return f"{got()}, where the call returns {expected} for these arguments"
    return None


def _same_static(a: Any, b: Any) -> bool:
  """Equality that is False for values of other types or that cannot be compared."""
  if type(a) is not type(b):
    return False
  try:
    return bool(a == b)
  except Exception:
    return False


def _leaf_type(leaf: Any) -> tuple[tuple[int, ...], Any, bool]:
  """Shape, dtype and whether the dtype is weak (Python scalars, weakly typed arrays)."""
  if type(leaf) in _PLAIN:
    return (), None, True
  shape = tuple(np.shape(leaf))
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    dtype = jax.dtypes.canonicalize_dtype(dtype)  # NumPy float64 is float32 to JAX.
  weak = bool(getattr(leaf, "weak_type", False))
  return shape, dtype, weak


class CallRecord:
  """What conversion saw of one call; the converter turns records into nodes."""

  __slots__ = ("module", "path", "method_name", "children", "extra", "spec")

  def __init__(self, module: Any, path: Path, method_name: Any):
    self.module = module
    self.path = path
    self.method_name = method_name
    self.children: list[tuple[CallKey, CallRecord]] = []
    self.extra: dict[str, Any] = {}
    self.spec: CallSpec | None = None

  def call_specs(self) -> tuple[CallSpec, ...]:
    """The specs of this call's submodule calls, for the node's `call_specs` field."""
    return tuple(child.spec for _, child in self.children if child.spec is not None)

  def walk(self) -> Iterator[CallRecord]:
    yield self
    for _, child in self.children:
      yield from child.walk()

  def where(self) -> str:
    """`"Block_0/Dense_0.__call__"`: the call's module path and method, for messages."""
    kind = self.module if isinstance(self.module, type) else type(self.module)
    name = self.method_name
    if not isinstance(name, str):
      name = getattr(name, "__name__", type(name).__name__)
    return f"{'/'.join(str(p) for p in self.path) or kind.__name__}.{name}"


# Errors JAX raises when code needs the value of an array that is only abstract.
_NEEDS_VALUES = (
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerIntegerConversionError,
  jax.errors.TracerArrayConversionError,
  jax.errors.NonConcreteBooleanIndexError,
)


@contextmanager
def converting(where: str) -> Iterator[None]:
  """Explains JAX's errors for code that needs array values while converting `where`.

  Conversion traces abstractly (arrays have shapes, not values), so a Python branch on
  an array's value cannot run; the error names the innermost call being converted.
  """
  try:
    yield
  except _NEEDS_VALUES as e:
    raise FlaxlensError(
      f"{where}: this call uses the value of an array in Python (`if float(h.mean()) >"
      f" 0`, `int(n)`, ...), which conversion cannot provide: it traces abstractly, with"
      f" shapes and no values ({type(e).__name__}). Compute the branch with jnp.where or"
      " jax.lax.cond, or, if it depends on an argument, pass that argument as a Python"
      " value (static) rather than an array."
    ) from e


class Frame:
  """One active call: where the calls made inside it are looked up or recorded."""

  __slots__ = (
    "path",
    "node",
    "record",
    "counter",
    "absorb",
    "lifted",
    "log",
    "jit_trace",
    "last",
    "reached",
  )

  def __init__(self, path: Path, node: Any = None, record: Any = None, absorb: Any = None):
    self.path = path
    self.node = node  # None while running: every call inside runs natively.
    self.record = record
    self.counter = 0
    self.reached: set[CallKey] = set()  # The keys of `node` the call has made.
    self.absorb = absorb  # The root method, whose own interception is not a child call.
    # After a transform announces a lifted call: [call name, index], so that a body the
    # transform traces twice (nn.scan does) maps both traces to one call and one node.
    self.lifted: list[Any] | None = None
    # While an inner jit runs: the names of the calls reported here (see `_inner_jit`).
    self.log: list[str] | None = None
    self.jit_trace: Any = None
    self.last: CallKey | None = None  # The key of the latest call made here.

  def next_key(self, name: str) -> tuple[CallKey, bool]:
    """The key of the next call named `name`, and whether it re-traces the last one."""
    if self.log is not None:
      self.log.append(name)
    lifted = self.lifted
    if lifted is not None and lifted[0] == name:
      self.last = (lifted[1], name)
      return self.last, True
    index = self.counter
    self.counter += 1
    if lifted is not None and lifted[0] is None:
      lifted[0], lifted[1] = name, index
    else:
      self.lifted = None
    self.last = (index, name)
    return self.last, False


class Pending:
  """A replaced call whose replacement may continue the original natively."""

  __slots__ = ("path", "method_name", "next_fun", "module", "origin")

  def __init__(
    self, path: Path, method_name: str, next_fun: Callable[..., Any], module: Any, origin: Any
  ):
    self.path = path
    self.method_name = method_name
    self.next_fun = next_fun
    self.module = module
    self.origin = origin

  def matches(self, node: CallNode) -> bool:
    """Whether `node` continues this call: same conversion, module path and method."""
    return (
      node.origin == self.origin and node.path == self.path and node.method_name == self.method_name
    )


def relative_name(frame_path: Path, path: Path) -> str:
  """How a caller at `frame_path` names the module at `path` in call keys."""
  if path == frame_path:
    return "self"
  if path[: len(frame_path)] == frame_path:
    return "/".join(str(p) for p in path[len(frame_path) :])
  return "/" + "/".join(str(p) for p in path)


_local = threading.local()


def current_interceptor() -> CallInterceptor | None:
  stack = getattr(_local, "stack", None)
  return stack[-1] if stack else None


def is_active(interceptor: CallInterceptor) -> bool:
  """Whether `interceptor` is active in this thread (innermost or not)."""
  return interceptor in getattr(_local, "stack", ())


class CallInterceptor:
  """Interception state of one native run of a converted model (or of its conversion)."""

  def __init__(self, side_inputs: dict[str, Any], building: bool, prefix: Path = ()):
    self.side_inputs = side_inputs
    self.building = building
    self.prefix = prefix
    self.frames: list[Frame] = []
    self.pending: list[Pending] = []
    # Part of an inner jit's cache key: unique unless the run sets a shared one.
    self.token = RunToken.unique(self)
    # Records the executions of one node (a `_record.Recorder`), for isolation.
    self.recorder: Any = None

  @contextmanager
  def active(self) -> Iterator[None]:
    """Makes this the interceptor that framework hooks report to."""
    if not hasattr(_local, "stack"):
      _local.stack = []
    _local.stack.append(self)
    try:
      yield
    finally:
      _local.stack.remove(self)

  def inner_jit(self, trace: Any) -> Any:
    """Context of one call of a framework's jit in the current frame; see `_inner_jit`."""
    call_path = tuple(f.last for f in self.frames[:-1])
    return inner_jit(self.frames[-1], call_path, self.token, trace)

  def run_frame(self, frame: Frame, fun: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    self.frames.append(frame)
    try:
      result = fun(*args, **kwargs)
    finally:
      self.frames.pop()
    self.check_reached(frame)
    return result

  def check_reached(self, frame: Frame) -> None:
    """Refuses a finished call that skipped one of its replaced submodule calls.

    A call may take another branch than at conversion; skipping a call is harmless
    unless that call was replaced, whose replacement would silently be dropped.
    """
    node = frame.node
    if node is None or len(frame.reached) == len(node.submodule_calls):
      return
    for key, child in node.submodule_calls.items():
      if key in frame.reached:
        continue
      if is_call_node(child) and child.origin == node.origin and pristine(child):
        continue
      raise CallStructureError(
        f"{node._describe(key)} is replaced (or holds replaced calls), but the caller"
        f" did not make it this time (it made {len(frame.reached)} of the"
        f" {len(node.submodule_calls)} calls seen at conversion), so the replacement"
        " would be dropped. Convert with example arguments that take the same branch as"
        " this call."
      )

  def continue_pending(self, node: CallNode, argument: ArgsAndKwargs) -> Any:
    pending = self.pending.pop()
    try:
      return self.run_node(
        node, pending.module, pending.next_fun, tuple(argument.args), dict(argument.kwargs)
      )
    finally:
      self.pending.append(pending)

  def run_node(
    self, node: CallNode, module: Any, next_fun: Callable[..., Any], args: Any, kwargs: Any
  ) -> Any:
    """Runs the call of `node` natively (recording it if it is the recorder's target)."""

    def run() -> Any:
      return self.run_frame(Frame(node.path, node=node), next_fun, args, kwargs)

    if self.recorder is not None and node is self.recorder.target:
      return self.recorder.observe(self, node, module, args, kwargs, run)
    return run()

  def record_call(self, record: CallRecord, module: Any, run: Callable[[], Any]) -> Any:
    """Runs a call being recorded; subclasses add what they learn from it."""
    with converting(record.where()):
      return run()

  def new_record(self, module: Any, path: Path, name: str) -> CallRecord:
    return CallRecord(module, path, name)

  def same_module(self, node: CallNode, module: Any) -> bool:
    """Whether `node` was converted from a module like `module` (same class)."""
    return True

  def dispatch(
    self,
    module: Any,
    path: Path,
    name: str,
    next_fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
  ) -> Any:
    """Handles one intercepted call of `module.name(*args, **kwargs)` at `path`."""
    frame = self.frames[-1]
    if frame.absorb is not None and path == frame.path and name == frame.absorb:
      frame.absorb = None
      return next_fun(*args, **kwargs)
    key, retrace = frame.next_key(f"{relative_name(frame.path, path)}.{name}")
    if self.building:
      record = self.new_record(module, path, name)
      if not retrace:
        frame.record.children.append((key, record))
      output = self.record_call(
        record, module, lambda: self.run_frame(Frame(path, record=record), next_fun, args, kwargs)
      )
      record.spec = CallSpec(key, path, name, args, kwargs, output)
      return output
    node = frame.node
    if node is None:
      return self.run_frame(Frame(path), next_fun, args, kwargs)
    frame.reached.add(key)
    child = node.submodule_calls.get(key, _MISSING)
    if is_call_node(child) and child.origin == node.origin:
      if child.path == path and child.method_name == name and self.same_module(child, module):
        return self.run_node(child, module, next_fun, args, kwargs)
      child = _MISSING  # A node of this tree made for another call: the calls changed.
    spec = node._call_spec(key)
    deleted = key not in node.submodule_calls and spec is not None
    if deleted and (spec.path, spec.method_name) == (path, name):
      child = None  # Conversion saw this very call: its entry was deleted.
    if child is _MISSING:
      self._diverged(frame, key)
      return self.run_frame(Frame(path), next_fun, args, kwargs)
    if child is None or not callable(child):
      what = "removed (None or deleted)" if child is None else f"a {type(child).__name__}"
      raise ReplacementError(
        f"{node._describe(key)} is {what}, which cannot run in its place. A call cannot be"
        " removed from a tree; replace it with an fl.Layer (any callable taking"
        " (argument, /, **side_inputs)) that returns what the call returns."
      )
    self.pending.append(Pending(path, name, next_fun, module, node.origin))
    try:
      output = child(ArgsAndKwargs(args=tuple(args), kwargs=dict(kwargs)), **self.side_inputs)
    finally:
      self.pending.pop()
    problem = spec.check(output, args, kwargs) if spec is not None else None
    if problem is not None:
      raise ReplacementError(
        f"{node._describe(key)}: its replacement {type(child).__name__} returned {problem}."
        " Return what the call returns (same structure, dtypes and shapes; a 1-tuple is"
        " not an array)."
      )
    return output

  def _diverged(self, frame: Frame, key: CallKey) -> None:
    node = frame.node
    if not pristine(node):
      seen = list(node.submodule_calls)
      raise CallStructureError(
        f"{node._describe(key)} was not made at conversion (conversion saw"
        f" {seen[:8]}), and this part of the tree has replaced calls that would no"
        " longer line up. Convert with example arguments that take the same branch."
      )
    frame.node = None


_MISSING = object()
