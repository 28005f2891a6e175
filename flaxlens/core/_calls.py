"""What Linen and NNX call trees share: call nodes and the dispatch of intercepted calls.

A converted model is run natively once per call of its root node; a framework hook
(Linen's method interceptor, NNX's instrumented classes) reports every submodule call to
a `CallInterceptor`. The interceptor keeps a stack of frames, one per active call, and
names each submodule call `(call_index, "Child.method")` within its caller. While
converting it records the calls; while running a tree it looks each call up in the
caller node's `submodule_calls`: a call node continues natively, any other layer replaces
the call (and may continue it natively by calling the node it wraps). No Flax internals.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax

from flaxlens._errors import CallStructureError, FlaxlensError
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._inner_jit import RunToken, inner_jit
from flaxlens.core._layer import Layer

CallKey = tuple[int, str]
Path = tuple[Any, ...]


class CallNode(Layer):
  """Base class of converted calls; subclasses have `path`, `method_name` and
  `submodule_calls` fields and run themselves with `_run_root`."""

  def readable_path(self) -> tuple[str, str]:
    """`("Block_0/Dense_0", "__call__")`: the module path and the method name."""
    name = self.method_name
    if not isinstance(name, str):
      name = getattr(name, "__name__", type(name).__name__)
    return "/".join(str(p) for p in self.path), name

  def _where(self) -> str:
    path, method = self.readable_path()
    return f"{path or self._module_type_name()}.{method}"

  def _module_type_name(self) -> str:
    return "model"

  def __call__(self, argument: ArgsAndKwargs, /, **side_inputs: Any) -> Any:
    if not isinstance(argument, ArgsAndKwargs):
      raise TypeError(
        f"{self._where()}: a converted call takes fl.ArgsAndKwargs.capture(*args,"
        f" **kwargs) as its argument, got {type(argument).__name__}."
      )
    interceptor = current_interceptor()
    if interceptor is not None and interceptor.pending and interceptor.pending[-1].matches(self):
      return interceptor.continue_pending(self, argument)
    return self._run_root(argument, **side_inputs)

  def _run_root(self, argument: ArgsAndKwargs, /, **side_inputs: Any) -> Any:
    raise NotImplementedError


def is_call_node(x: Any) -> bool:
  return isinstance(x, CallNode)


def iter_call_nodes(tree: Any) -> Iterator[CallNode]:
  """All call nodes of `tree`, parents first, also those inside replacement layers."""
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_call_node):
    if is_call_node(leaf):
      yield leaf
      yield from iter_call_nodes(leaf.submodule_calls)


def pristine(node: CallNode) -> bool:
  """Whether no call under `node` has been replaced."""
  return all(is_call_node(c) and pristine(c) for c in node.submodule_calls.values())


class CallRecord:
  """What conversion saw of one call; the converter turns records into nodes."""

  __slots__ = ("module", "path", "method_name", "children", "extra")

  def __init__(self, module: Any, path: Path, method_name: Any):
    self.module = module
    self.path = path
    self.method_name = method_name
    self.children: list[tuple[CallKey, CallRecord]] = []
    self.extra: dict[str, Any] = {}

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

  __slots__ = ("path", "node", "record", "counter", "absorb", "lifted", "log", "jit_trace", "last")

  def __init__(self, path: Path, node: Any = None, record: Any = None, absorb: Any = None):
    self.path = path
    self.node = node  # None while running: every call inside runs natively.
    self.record = record
    self.counter = 0
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

  __slots__ = ("path", "method_name", "next_fun", "module")

  def __init__(self, path: Path, method_name: str, next_fun: Callable[..., Any], module: Any):
    self.path = path
    self.method_name = method_name
    self.next_fun = next_fun
    self.module = module

  def matches(self, node: CallNode) -> bool:
    return node.path == self.path and node.method_name == self.method_name


def owner_of(path: Path, called: set[Path] | frozenset[Path]) -> Path:
  """The longest called module path that is a proper prefix of a variable's `path`.

  A variable belongs to its module's calls, or, if that module makes no call of its
  own, to the calls of its nearest calling ancestor (the root always calls).
  """
  for end in range(len(path) - 1, 0, -1):
    if path[:end] in called:
      return path[:end]
  return ()


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
      return fun(*args, **kwargs)
    finally:
      self.frames.pop()

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
    """Runs the call of `node` natively; subclasses may observe it."""
    return self.run_frame(Frame(node.path, node=node), next_fun, args, kwargs)

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
      return self.record_call(
        record, module, lambda: self.run_frame(Frame(path, record=record), next_fun, args, kwargs)
      )
    if frame.node is None:
      return self.run_frame(Frame(path), next_fun, args, kwargs)
    child = frame.node.submodule_calls.get(key)
    if is_call_node(child) and child.path == path and self.same_module(child, module):
      return self.run_node(child, module, next_fun, args, kwargs)
    if child is None or is_call_node(child):
      self._diverged(frame, key)
      return self.run_frame(Frame(path), next_fun, args, kwargs)
    self.pending.append(Pending(path, name, next_fun, module))
    try:
      return child(ArgsAndKwargs(args=tuple(args), kwargs=dict(kwargs)), **self.side_inputs)
    finally:
      self.pending.pop()

  def _diverged(self, frame: Frame, key: CallKey) -> None:
    node = frame.node
    if not pristine(node):
      seen = list(node.submodule_calls)
      raise CallStructureError(
        f"{node._where()}: call {key} was not made at conversion (conversion saw"
        f" {seen[:8]}), and this part of the tree has replaced calls that would no"
        " longer line up. Convert with example arguments that take the same branch."
      )
    frame.node = None
