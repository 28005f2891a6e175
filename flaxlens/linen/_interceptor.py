"""`LinenInterceptor`: receives Linen's method-interceptor callbacks for one `apply`.

Flax calls the interceptor for every module method call (`nn.intercept_methods`); it
names the call within its caller and hands it to the framework-neutral dispatch of
`CallInterceptor`. It also keys Flax's `nn.jit` caches on the run, and applies settings
edited in a node's module (`module.clone(dtype=...)`) for the duration of its call.
Flax internals used: through `flaxlens._compat` (`linen_modules`, `linen_lift`, `tracing`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import flax.linen as nn
import jax
from flax import errors as flax_errors

from flaxlens._compat import linen_lift, linen_modules, tracing
from flaxlens.core._active import current_interceptor
from flaxlens.core._call_record import CallRecord
from flaxlens.core._calls import CallInterceptor
from flaxlens.core._names import Path
from flaxlens.core._node import CallNode
from flaxlens.errors import FlaxlensError

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
  _inlined_body = False  # The next call is the body of an inlined nn.jit call.
  _capturing = False  # Whether a capture filter made by `capture_only_native` is in use.

  def intercept(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    if current_interceptor() is not self or context.method_name == "setup":
      return next_fun(*args, **kwargs)
    module = context.module
    if linen_modules.is_setup_check(module):
      return next_fun(*args, **kwargs)
    if self._inlined_body:
      # The body of an nn.jit this run inlines (see `active`): jits inside it compile.
      self._inlined_body = False
      with jax.disable_jit(False):
        return self.intercept(next_fun, args, kwargs, context)
    path = self.prefix + linen_modules.module_path(module)
    body = linen_modules.intercepted_function(context)
    if self.building:  # Conversion runs every call natively (no `native` frame).
      output = self.dispatch(module, path, context.method_name, next_fun, args, kwargs, body)
      self._not_run = None
      return output
    if not self._capturing:  # No capture filter asks which calls ran natively.
      return self.dispatch(module, path, context.method_name, next_fun, args, kwargs, body)
    ran = []

    def native(*a: Any, **k: Any) -> Any:
      ran.append(True)
      return next_fun(*a, **k)

    output = self.dispatch(module, path, context.method_name, native, args, kwargs, body)
    self._not_run = None if ran else (module, context.method_name)
    return output

  def capture_only_native(
    self, capture: Callable[[Any, str], bool] | None
  ) -> Callable[[Any, str], bool] | None:
    """`capture` (a `capture_intermediates` filter) minus calls that did not run natively."""
    if capture is None:
      return None
    self._capturing = True

    def only_native(module: Any, method_name: str) -> bool:
      not_run, self._not_run = self._not_run, None
      if not_run is not None and not_run[0] is module and not_run[1] == method_name:
        return False
      return capture(module, method_name)

    return only_native

  @contextmanager
  def active(self) -> Iterator[None]:
    """Reports calls; `nn.jit` calls key their traces on the run.

    A run that captures inlines `nn.jit` calls instead (`jax.disable_jit` around the
    jitted call, jit enabled again inside its body), so that values captured in the
    body belong to the run's trace: compiled with the run under `fl.run`'s jit.
    """
    opened: list[Any] = []
    inlined: list[Any] = []

    def start() -> Any:
      context = self.inner_jit(tracing.current_trace())
      key = context.__enter__()
      opened.append(context)
      inline = None
      if self.probing is not None and self.probing.capturing:
        inline = jax.disable_jit(True)
        inline.__enter__()
        self._inlined_body = True
      inlined.append(inline)
      return key

    def finish() -> None:
      opened.pop().__exit__(None, None, None)
      inline = inlined.pop()
      if inline is not None:
        inline.__exit__(None, None, None)

    try:
      with (
        super().active(),
        nn.intercept_methods(self.intercept),
        linen_lift.jit_keys(start, finish),
        linen_lift.lifted_calls(self._lifted_call),
      ):
        yield
    finally:
      while inlined:  # A jitted call raised: leave jit enabled as it was.
        inline = inlined.pop()
        if inline is not None:
          inline.__exit__(None, None, None)
      self._inlined_body = False

  def reported_name(self, method: Any) -> str | None:
    return linen_modules.reported_method_name(method)

  def _lifted_call(self) -> None:
    """A lifted transform starts a call: its body's traces are one call of this frame."""
    if current_interceptor() is self and self.frames:
      self.frames[-1].lifted_call(tracing.current_trace())

  def new_record(self, module: Any, path: Path, name: str) -> CallRecord:
    record = CallRecord(linen_modules.unbound_clone(module), path, name)
    lifted_by = linen_modules.lifting_transforms(module)
    record.extra["lifted_by"] = lifted_by
    record.extra["sliced"] = any(t not in _SHAPE_PRESERVING_LIFTS for t in lifted_by)
    return record

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
    with linen_modules.fields_set(module, fields):
      try:
        return super().run_node(node, module, next_fun, args, kwargs)
      except _UNFIT_EDIT as e:
        raise FlaxlensError(
          f"{node.where()}: the edited settings {sorted(fields)} do not fit the variables"
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
    recorded = node.converted_module
    if node.module is recorded or recorded is None:
      return {}
    where = node.where()
    if type(node.module) is not type(recorded) or node.module.name != recorded.name:
      raise FlaxlensError(
        f"{where}: the node's module was replaced by a {type(node.module).__name__} named"
        f" {node.module.name!r}; a node's module can only change its settings"
        " (module.clone(dtype=...)). To run other code here, replace the call with a layer."
      )
    fields = changed_fields(node.module, recorded)
    held = [n for n, v in fields.items() if isinstance(v, nn.Module)]
    if held or (fields and defines_setup(module)):
      what = f"the submodules {held}" if held else "settings of a module with setup()"
      raise FlaxlensError(
        f"{where}: the edit changes {what}, which Flax has used before the call starts"
        " (setup runs first). Edit settings of modules without setup, such as the"
        " submodules' own nodes, or convert a model built with the new settings."
      )
    return fields


def changed_fields(module: nn.Module, recorded: nn.Module) -> dict[str, Any]:
  """The dataclass fields (settings) of `module` whose values differ from `recorded`'s."""
  changed = {}
  for field in dataclasses.fields(module):
    if field.name == "parent" or not field.init:
      continue
    new, old = getattr(module, field.name), getattr(recorded, field.name)
    if new is old:
      continue
    try:
      same = bool(new == old)
    except Exception:
      same = False
    if not same:
      changed[field.name] = new
  return changed


def defines_setup(module: nn.Module) -> bool:
  """Whether the module's class has a `setup` (which Flax runs before any interceptor)."""
  return type(module).setup is not nn.Module.setup


# Lifted transforms that run their body on the whole variables (no slicing).
_SHAPE_PRESERVING_LIFTS = ("jit", "remat", "checkpoint", "named_call")
