"""The dispatch of intercepted calls: what Linen and NNX runs share while they run.

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
  was replaced raises `CallStructureError` (unreplaced calls may be skipped freely;
  probed ones are checked by the probing, `_probes`).
- A call a lifted transform's body makes in its caller is one call, however often the
  transform traces the body, nested lifted transforms included (`Frame.lifted_call`).
- The root method's own report (a method given by name, or as a function the framework
  intercepts, `reported_name`) is the root call, not a call inside it.
- An entry cannot be removed (None, or deleted from `submodule_calls`); a replacement
  must be callable, and its output must have the structure, dtype and shape the
  replaced call had at conversion for the same kind of arguments (`CallSpec.check`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flaxlens.core._active import activated
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._call_record import CallRecord, converting
from flaxlens.core._inner_jit import RunToken, inner_jit
from flaxlens.core._names import CallKey, Path
from flaxlens.core._node import CallNode, is_call_node
from flaxlens.core._spec import CallSpec
from flaxlens.core._walk import pristine
from flaxlens.errors import CallStructureError, ReplacementError


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
    "bodies",
    "rewound",
  )

  def __init__(self, path: Path, node: Any = None, record: Any = None, absorb: Any = None):
    self.path = path
    self.node = node  # None while running: every call inside runs natively.
    self.record = record
    self.counter = 0
    self.reached: set[CallKey] = set()  # The keys of `node` the call has made.
    self.absorb = absorb  # The root method, whose own interception is not a child call.
    # After a transform announces a lifted call (`lifted_call`): [call name, index, the
    # JAX trace it was announced in, the body's function], so that a body the transform
    # traces twice (nn.scan does) maps both traces to one call and one node, while the
    # bodies of one transform that share a name (`nn.switch` branches written as lambdas)
    # stay calls of their own.
    self.lifted: list[Any] | None = None
    # While an inner jit runs: the names of the calls reported here (see `_inner_jit`).
    self.log: list[str] | None = None
    self.jit_trace: Any = None
    self.last: CallKey | None = None  # The key of the latest call made here.
    # Bodies a transform traces more than once (`traced_body`): id -> (first key index,
    # index after the first trace, the body, kept alive while its id is a key here).
    self.bodies: dict[int, tuple[int, int, Any]] | None = None
    self.rewound: int | None = None  # While a body is traced again: its first trace's end.

  @contextmanager
  def traced_body(self, body: Any) -> Iterator[None]:
    """A trace of `body`, a function a transform traces (once or more) in this frame.

    A second trace of the same body makes the same calls, so they get the keys of the
    first: one call each, edited and captured in every trace, as a body Linen's lifted
    transforms trace twice is (`lifted_call`).
    """
    bodies = self.bodies if self.bodies is not None else {}
    self.bodies = bodies
    seen = bodies.get(id(body))
    if seen is None:
      start = self.counter
      yield
      bodies[id(body)] = (start, self.counter, body)
      return
    start, end, _ = seen
    counter, rewound = self.counter, self.rewound
    self.counter, self.rewound = start, end
    try:
      yield
    finally:
      self.counter, self.rewound = max(counter, self.counter), rewound

  def lifted_call(self, trace: Any) -> None:
    """A lifted transform starts a call here, in the JAX trace `trace`.

    The call its body makes here is one call, however often the transform traces the
    body. A lifted transform started inside that body (in another trace: `nn.remat`
    inside `nn.scan`) is part of the same call, traced again with it.
    """
    lifted = self.lifted
    if lifted is not None and lifted[2] != trace:
      return
    self.lifted = [None, None, trace, None]

  def next_key(self, name: str, body: Any = None) -> tuple[CallKey, bool]:
    """The key of the next call named `name`, and whether it re-traces the last one:
    the same name and, where the framework says which function runs (`body`), the same
    function."""
    if self.log is not None:
      self.log.append(name)
    if self.rewound is not None and self.counter < self.rewound:
      self.last = (self.counter, name)
      self.counter += 1
      return self.last, True
    lifted = self.lifted
    if lifted is not None and lifted[0] == name and lifted[3] is body:
      self.last = (lifted[1], name)
      return self.last, True
    index = self.counter
    self.counter += 1
    if lifted is not None and (lifted[0] is None or lifted[0] == name):
      # The transform's first body, or another body of the same transform under the
      # same name (the next branch): later traces of this body are re-traces of it.
      lifted[0], lifted[1], lifted[3] = name, index, body
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


@functools.lru_cache(maxsize=8192)
def call_name(frame_path: Path, path: Path, method: str) -> str:
  """The name of a call of `method` of the module at `path`, made at `frame_path`."""
  return f"{relative_name(frame_path, path)}.{method}"


def relative_name(frame_path: Path, path: Path) -> str:
  """How a caller at `frame_path` names the module at `path` in call keys."""
  if path == frame_path:
    return "self"
  if path[: len(frame_path)] == frame_path:
    return "/".join(str(p) for p in path[len(frame_path) :])
  return "/" + "/".join(str(p) for p in path)


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
    # Records the executions of one node (a `_recorder.Recorder`), for isolation.
    self.recorder: Any = None
    # Interventions and captures at chosen nodes (a `_probes.Probing`), or None.
    self.probing: Any = None

  @contextmanager
  def active(self) -> Iterator[None]:
    """Makes this the interceptor that framework hooks report to."""
    with activated(self):
      yield

  def reported_name(self, method: Any) -> str | None:
    """The name the framework reports a call of the root `method` under, or None if
    calling it reports nothing: that report is the root call itself (`Frame.absorb`)."""
    return method if isinstance(method, str) else None

  def inner_jit(self, trace: Any) -> Any:
    """Context of one call of a framework's jit in the current frame; see `_inner_jit`."""
    call_path = tuple(f.last for f in self.frames[:-1])
    reached = self.probing.reached if self.probing is not None else None
    return inner_jit(self.frames[-1], call_path, self.token, trace, reached)

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
    """Runs the call of `node` natively (through the run's `EditedCall` for it, if any,
    and recorded if it is the target).

    A plain call runs here rather than through `_run_node` and `run_frame`: JAX records
    the Python stack while it traces (Flax traces every parameter initializer at every
    apply), so each frame a nested call adds costs time.
    """
    probing = self.probing
    edited = probing.edited_calls.get(id(node)) if probing is not None else None
    if edited is None and (self.recorder is None or node is not self.recorder.target):
      frame = Frame(node.path, node=node)
      self.frames.append(frame)
      try:
        result = next_fun(*args, **kwargs)
      finally:
        self.frames.pop()
      self.check_reached(frame)
      return result
    if edited is None:
      return self._run_node(node, module, next_fun, args, kwargs)
    return edited.around(
      lambda a: self._run_node(node, module, next_fun, tuple(a.args), dict(a.kwargs)),
      ArgsAndKwargs(args=tuple(args), kwargs=dict(kwargs)),
      probing,
    )

  def _run_node(
    self, node: CallNode, module: Any, next_fun: Callable[..., Any], args: Any, kwargs: Any
  ) -> Any:
    def run() -> Any:
      return self.run_frame(Frame(node.path, node=node), next_fun, args, kwargs)

    if self.recorder is not None and node is self.recorder.target:
      return self.recorder.observe(self, node, module, args, kwargs, run)
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
    body: Any = None,
  ) -> Any:
    """Handles one intercepted call of `module.name(*args, **kwargs)` at `path`; `body`
    is the function the call runs, where the framework says (None where not)."""
    frame = self.frames[-1]
    if frame.absorb is not None and path == frame.path and name == frame.absorb:
      frame.absorb = None
      if not self.building:
        return next_fun(*args, **kwargs)
      output = next_fun(*args, **kwargs)  # The root's own call: its record keeps its spec.
      frame.record.spec = CallSpec(
        (0, call_name(path, path, name)), path, name, args, kwargs, output
      )
      return output
    key, retrace = frame.next_key(call_name(frame.path, path, name), body)
    if self.building:
      record = self.new_record(module, path, name)
      if not retrace:
        frame.record.children.append((key, record))
      # The call runs right here, not through `run_frame`: JAX saves the Python stack
      # with every operation it traces, so each frame added per call level slows the
      # tracing of everything below it.
      self.frames.append(Frame(path, record=record))
      try:
        with converting(record):
          output = next_fun(*args, **kwargs)
      finally:
        self.frames.pop()
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
    spec = node.call_spec(key)
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
    try:  # `failed_call` knows this frame by its locals: `spec`, and `child` a layer.
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
    if self.probing is not None:
      self.probing.diverged.append(node._describe(key))
    frame.node = None


_MISSING = object()


def failed_call(traceback: Any) -> tuple[str, Any, Any, Any] | None:
  """Where a run that raised was when it raised: the innermost call the traceback passes.

  `("call", node, args, kwargs)` for a converted call running natively, `("replacement",
  layer, args, kwargs)` for a replacement layer, None if the run raised before reaching
  any submodule call (in the root's own code). Read only after a failure, from the
  locals of the dispatch's frames (so a run keeps no record of where it is): `run_node`
  and `run_frame` hold the node, `dispatch` running a replacement has its `spec` and a
  layer as `child`.
  """
  site = None
  while traceback is not None:
    code = traceback.tb_frame.f_code
    if code in _SITES:
      local = traceback.tb_frame.f_locals
      args, kwargs = local.get("args"), local.get("kwargs")
      if code is _DISPATCH:
        child = local.get("child", _MISSING)
        if "spec" in local and child is not _MISSING:
          site = ("replacement", child, args, kwargs)
      else:
        node = local.get("node") if code is _RUN_NODE else getattr(local.get("frame"), "node", None)
        if node is not None:
          site = ("call", node, args, kwargs)
    traceback = traceback.tb_next
  return site


def converting_call(traceback: Any) -> tuple[Any, Any, Any] | None:
  """The innermost call a conversion that raised was recording: `(record, args, kwargs)`,
  read from the locals of `dispatch`'s frames (None: it raised in the root's own code)."""
  site = None
  while traceback is not None:
    if traceback.tb_frame.f_code is _DISPATCH:
      local = traceback.tb_frame.f_locals
      if isinstance(local.get("record"), CallRecord):
        site = (local["record"], local.get("args"), local.get("kwargs"))
    traceback = traceback.tb_next
  return site


_RUN_NODE = CallInterceptor.run_node.__code__
_DISPATCH = CallInterceptor.dispatch.__code__
_SITES = frozenset({_RUN_NODE, _DISPATCH, CallInterceptor.run_frame.__code__})
