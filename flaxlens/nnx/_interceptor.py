"""`NNXInterceptor`: instrumenting the classes of a private copy so its calls report.

NNX has no interception hook. While a run is active, the methods of the copy's classes
are wrapped in place and report the calls of modules that carry a site of the run; see
`NNXInterceptor`. Flax internals used: through
`flaxlens._compat` (`nnx_graph`, `nnx_jit`, `patching`, `tracing`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from flaxlens._compat import nnx_graph, nnx_jit, nnx_loops, nnx_variables, patching, tracing
from flaxlens.core._active import is_active
from flaxlens.core._call_record import CallRecord
from flaxlens.core._calls import CallInterceptor
from flaxlens.core._inner_jit import RunToken
from flaxlens.core._names import Path
from flaxlens.core._node import CallNode


def call_method(model: Any, method: Any, args: Any, kwargs: Any) -> Any:
  """Calls `method` (a name, or a function taking the module first) of `model`."""
  if isinstance(method, str):
    return getattr(model, method)(*args, **kwargs)
  return method(model, *args, **kwargs)


_STDLIB_MODULES = ("builtins", "abc", "typing", "collections.abc")


class _Site(NamedTuple):
  """What a module of a run's private copy carries (static, so it survives transforms).

  `token` finds the run and keys inner jits on it; `jit` is the key of the jitted call
  the module is passed to, while that call runs.
  """

  path: Path
  token: RunToken
  jit: Any = None


def _is_flax_base(cls: type) -> bool:
  return cls in nnx_graph.flax_bases() or cls.__module__ in _STDLIB_MODULES


def _is_method(attr: Any) -> bool:
  if isinstance(attr, type | staticmethod | classmethod | property):
    return False
  return inspect.isfunction(attr) or (callable(attr) and hasattr(type(attr), "__get__"))


@functools.cache
def _reported(cls: type) -> tuple[tuple[type, str], ...]:
  """`(defining class, name)` of the methods of `cls` that report calls.

  The public methods and `__call__` that `cls` and its bases define, up to (not
  including) NNX's own base and container classes, each at the class that defines the
  one `cls` uses.
  """
  found = []
  for name in sorted({n for k in cls.__mro__ for n in vars(k)}):
    if name.startswith("_") and name != "__call__":
      continue
    definer = _definer(cls, name)
    if not _is_flax_base(definer) and _is_method(vars(definer)[name]):
      found.append((definer, name))
  return tuple(found)


@functools.cache
def _definer(cls: type, name: str) -> type:
  return next(k for k in cls.__mro__ if name in vars(k))


def _report(definer: type, name: str) -> Callable[[Any], Callable[..., Any]]:
  """Wraps `definer.name` so that a module of an active run reports its calls."""

  def wrap(method: Any) -> Callable[..., Any]:
    try:
      return _reporting(definer, name, method)
    except TypeError:  # A method object that cannot be hashed: wrapped afresh.
      return _reporting.__wrapped__(definer, name, method)

  return wrap


@functools.lru_cache(maxsize=4096)
def _reporting(definer: type, name: str, method: Any) -> Callable[..., Any]:
  """The wrapper of `method` (`definer.name`), made once and installed at every run."""
  definers: dict[type, type] = {}  # The class each calling type takes `name` from.

  def reporting(self: Any, *args: Any, **kwargs: Any) -> Any:
    cls = type(self)
    bound = method.__get__(self, cls)
    site = nnx_graph.site(self)
    if site is None:
      return bound(*args, **kwargs)  # Not a run's module.
    found = definers.get(cls)
    if found is None:
      found = definers[cls] = _definer(cls, name)
    if found is not definer:
      return bound(*args, **kwargs)  # Reached through super() from an override.
    interceptor = site.token.interceptor
    if interceptor is None or not interceptor.frames or not is_active(interceptor):
      return bound(*args, **kwargs)
    return interceptor.dispatch(self, site.path, name, bound, args, kwargs)

  functools.update_wrapper(reporting, method, updated=())
  return reporting


def _variable_shapes(module: Any) -> tuple[Any, ...]:
  return tuple(
    (tuple(p), getattr(nnx_variables.raw_value(v), "shape", None))
    for p, v in nnx.to_flat_state(nnx.state(module))
  )


class NNXInterceptor(CallInterceptor):
  """Receives the calls reported by the modules of one private copy of a model.

  While active, the methods of the copy's classes are wrapped in place (in the
  `__dict__` of the classes that define them) and restored exactly afterwards. A
  wrapper reports a call only for a module carrying a site of an active run of this
  thread; any other call of the class (the user's own model, another thread) runs the
  original method directly. So `type(module)` is the user's class, the `GraphDef`
  records it, and no class is ever created: user `__init_subclass__` hooks and class
  registries see nothing. (Swapping each instance's class for a cached subclass, the
  earlier design, made `type(m) is nnx.Linear` false inside a call and ran those hooks.)
  Inner `nnx.jit` calls key their traces on the run and on the jitted call's position,
  by putting that key into the site attributes of the modules they are passed.
  """

  def __init__(self, side_inputs: dict[str, Any], building: bool):
    super().__init__(side_inputs, building)
    self.modules: dict[int, Any] = {}  # id -> module, for the copy's own instances
    self.by_path: dict[Path, Any] = {}
    self.classes: set[type] = set()

  def instrument(self, modules: Iterable[tuple[Path, Any]], prefix: Path) -> None:
    """Records its path on every module of `(relative path, module)` pairs of a model.

    The modules' classes are wrapped while the interceptor is active.
    """
    for rel, module in modules:
      path = prefix + tuple(rel)
      self.by_path[path] = module
      self.classes.add(type(module))
      nnx_graph.set_site(module, _Site(path, self.token))
      self.modules[id(module)] = module

  def mark(self, sites: Iterable[tuple[Path, Any]], classes: frozenset[type]) -> None:
    """`instrument` for a run (not a conversion): `(full path, module)` pairs, whose
    classes are `classes`; only the sites are set (`by_path` is for conversions)."""
    token = self.token
    for path, module in sites:
      nnx_graph.set_site(module, _Site(path, token))
    self.classes |= classes

  @contextmanager
  def active(self) -> Iterator[None]:
    methods = {pair for cls in self.classes for pair in _reported(cls)}
    wrappers = {(definer, name): _report(definer, name) for definer, name in methods}
    with (
      patching.patched(wrappers),
      nnx_jit.jit_keys(self._jit_call),
      nnx_loops.body_traces(self._body_trace),
      super().active(),
    ):
      yield

  def _body_trace(self, body: Any, trace: Callable[[], Any]) -> Any:
    """One trace of an `nnx.fori_loop` body: traced again, its calls keep their keys."""
    if not self.frames:
      return trace()
    with self.frames[-1].traced_body(body):
      return trace()

  def _jit_call(
    self, call: Callable[[], Any], arguments: Any, inline: Callable[[], Any], donates: bool
  ) -> Any:
    """Runs one `nnx.jit` call with the run's key in its modules' sites.

    A run that captures calls the jitted function inline instead, so that values
    captured in it belong to the run's trace (compiled with the run under `fl.run`'s
    jit); the function updates the modules in place, as `nnx.jit` would. A jitted
    function that donates its arguments, called eagerly, first gets copies of the
    arrays of the copy's modules: they are the tree's (and the user's model's) own
    buffers, which donation would delete.
    """
    if self.probing is not None and self.probing.capturing and self.frames:
      return inline()
    ours = [
      m
      for leaf in jax.tree_util.tree_leaves(arguments, is_leaf=_is_module)
      if _is_module(leaf)
      for _, m in nnx_graph.iter_modules(leaf)
      if _site_of(m, self) is not None
    ]
    if donates and ours and tracing.at_top_level():
      _own_buffers(ours)
    if not ours or not self.frames:
      return call()
    sites = [nnx_graph.site(m) for m in ours]
    with self.inner_jit(tracing.current_trace()) as key:
      for module, site in zip(ours, sites, strict=True):
        nnx_graph.set_site(module, site._replace(jit=key[1]))
      try:
        return call()
      finally:
        for module, site in zip(ours, sites, strict=True):
          nnx_graph.set_site(module, site)

  def new_record(self, module: Any, path: Path, name: str) -> CallRecord:
    record = CallRecord(type(module), path, name)
    if id(module) not in self.modules:
      # A transform re-created the module inside its trace; it slices the variables
      # (nnx.scan, nnx.vmap) when their shapes differ from the model's own.
      record.extra["sliced"] = _variable_shapes(module) != _variable_shapes(self.by_path[path])
    return record

  def same_module(self, node: CallNode, module: Any) -> bool:
    return node.module_type is type(module)


def _own_buffers(modules: list[Any]) -> None:
  """Gives every variable of `modules` (made by a run, at the top level) a copy of its
  JAX array, so that a donating `nnx.jit` call deletes only the copies."""
  seen: set[int] = set()
  for module in modules:
    if id(module) in seen:
      continue
    for _, value in nnx.iter_graph(module):
      if id(value) in seen:
        continue
      seen.add(id(value))
      if isinstance(value, nnx.Variable):
        raw = nnx_variables.raw_value(value)
        if isinstance(raw, jax.Array):
          nnx_variables.set_raw_value(value, jnp.copy(raw))


def _is_module(x: Any) -> bool:
  return isinstance(x, nnx.Module)


def _site_of(module: Any, interceptor: NNXInterceptor) -> _Site | None:
  site = nnx_graph.site(module)
  return site if site is not None and site.token.interceptor is interceptor else None
