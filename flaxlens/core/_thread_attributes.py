"""Module attributes that read differently inside one thread's runs, and nowhere else.

`ScopedAttributes` lets the code of a run see a wrapper where it looks up a module's
function (`jax.lax.scan`) without replacing that function: while at least one user is
active, the module's class is a subclass of its own whose property for the name returns
the wrapper to lookups made while `applies()` holds (a predicate on the looking-up
thread's own state) and the module's own attribute otherwise. So the attribute's value
never changes: another thread, or the run's thread outside a run, gets the very object
that was there (`jax.lax.scan is original` holds everywhere), and its calls reach it
with their own arguments. The class change is reference-counted across nested and
concurrent users under a lock, the first installing it and the last restoring the
module's previous class, in `finally`. No Flax or JAX internals here: only the module
objects' classes, which Python lets a `types.ModuleType` subclass replace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any


class ScopedAttributes:
  """Wrappers of module attributes that only lookups for which `applies()` holds see.

  Args:
    wrappers: `{(module, name): make}`: while installed, a lookup of `module.name` for
      which `applies()` holds returns `make(original)`, made once per installation from
      the value the module held then.
    applies: called at every lookup of a wrapped name while installed; it reads the
      looking-up thread's state (a thread-local), so other threads see the original.

  Example:
    >>> import types
    >>> from flaxlens.core._thread_attributes import ScopedAttributes
    >>> module = types.ModuleType("m")
    >>> module.f = abs
    >>> inside = [False]
    >>> scoped = ScopedAttributes({(module, "f"): lambda f: (lambda x: -f(x))}, lambda: inside[0])
    >>> with scoped.installed():
    ...   outside = module.f is abs
    ...   inside[0] = True
    ...   wrapped = module.f(3)
    ...   inside[0] = False
    >>> outside, wrapped, module.f is abs, type(module) is types.ModuleType
    (True, -3, True, True)
  """

  def __init__(
    self,
    wrappers: Mapping[tuple[ModuleType, str], Callable[[Any], Any]],
    applies: Callable[[], bool],
  ):
    self._by_module: dict[int, tuple[ModuleType, dict[str, Callable[[Any], Any]]]] = {}
    for (module, name), make in wrappers.items():
      self._by_module.setdefault(id(module), (module, {}))[1][name] = make
    self._applies = applies
    self._lock = threading.Lock()
    self._users = 0
    self._previous: list[tuple[ModuleType, type]] = []
    # The subclass made for a module's class and original values, kept for the next
    # installation (making a class and its wrappers costs more than a run's bookkeeping).
    self._classes: dict[tuple[Any, ...], type] = {}

  @contextmanager
  def installed(self) -> Iterator[None]:
    """While active (in any thread), lookups for which `applies()` holds see the wrappers."""
    with self._lock:
      if self._users == 0:
        self._install()
      self._users += 1
    try:
      yield
    finally:
      with self._lock:
        self._users -= 1
        if self._users == 0:
          self._restore()

  def _install(self) -> None:
    try:
      for module, makes in self._by_module.values():
        base = type(module)
        originals = tuple(vars(module)[name] for name in makes)
        key = (id(module), base, *map(id, originals))
        scoped = self._classes.get(key)
        if scoped is None:
          properties = {
            name: _scoped_property(name, make(original), self._applies)
            for (name, make), original in zip(makes.items(), originals, strict=True)
          }
          scoped = type(f"{base.__name__}WithScopedAttributes", (base,), properties)
          self._classes[key] = scoped
        module.__class__ = scoped
        self._previous.append((module, base))
    except BaseException:
      self._restore()
      raise

  def _restore(self) -> None:
    while self._previous:
      module, base = self._previous.pop()
      module.__class__ = base


def _scoped_property(name: str, wrapper: Any, applies: Callable[[], bool]) -> property:
  def get(module: ModuleType) -> Any:
    if applies():
      return wrapper
    try:
      return module.__dict__[name]
    except KeyError:
      raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}") from None

  def set_(module: ModuleType, value: Any) -> None:
    module.__dict__[name] = value

  def delete(module: ModuleType) -> None:
    del module.__dict__[name]

  return property(get, set_, delete)
