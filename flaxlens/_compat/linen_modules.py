"""Linen modules as flaxlens reads them: paths, clones, held modules, compact state, names.

Checked with flax 0.12.6–0.12.8. A bound module's path and lifts are read from its scope
(`Scope.path`, `Scope.debug_path`); its unbound copy is `Module.clone(_deep_clone=True,
_reset_names=True)`; the modules it holds in attributes are adopted where
`Module.bind` (`_register_submodules`) puts them; a helper method called inside a compact
method runs in that method's `Module._state` (`in_compact_method`, `autoname_cursor`);
Flax's setup check of lifted modules binds a clone to `flax.linen.module.TestScope`;
a root method given as a function is reported under the name
`flax.linen.module._get_fn_name` gives the function its `method_handler_wrapped` wrapper
wraps; `capture_intermediates=True` is `flax.linen.module.capture_call_intermediates`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
from flax.core import unfreeze

from flaxlens._compat import Internal, unsupported

TEST_SCOPE = Internal("flax.linen.module", "TestScope")
GET_FN_NAME = Internal("flax.linen.module", "_get_fn_name")
CAPTURE_CALL_INTERMEDIATES = Internal("flax.linen.module", "capture_call_intermediates")


def module_path(module: nn.Module) -> tuple[str, ...]:
  """The scope path of a bound Linen module, as a tuple of names."""
  return tuple(module.scope.path)


def lifting_transforms(module: nn.Module) -> tuple[str, ...]:
  """Names of the lifted transforms (`scan`, `vmap`, `jit`, ...) a module runs inside.

  Read from `Scope.debug_path`, whose segments read `"scan(layers)"` inside a lift.
  """
  found = []
  for segment in module.scope.debug_path:
    if isinstance(segment, str) and segment.endswith(")") and "(" in segment:
      found.append(segment.split("(", 1)[0])
  return tuple(found)


def unbound_clone(module: nn.Module) -> nn.Module:
  """An unbound copy of a bound Linen module that keeps its name and settings.

  Submodules held in attributes are cloned too (and unnamed), so no scope of the
  conversion trace leaks into the tree.
  """
  return module.clone(parent=None, _deep_clone=True, _reset_names=True, name=module.name)


@contextlib.contextmanager
def fields_set(module: nn.Module, fields: dict[str, Any]) -> Iterator[None]:
  """Sets dataclass fields of a bound module for the duration of one call, then restores.

  Bound modules refuse attribute changes (`SetAttributeFrozenModuleError`); the call
  that runs inside reads the fields as a module built with them would.
  """
  old = {name: getattr(module, name) for name in fields}
  try:
    for name, value in fields.items():
      object.__setattr__(module, name, value)
    yield
  finally:
    for name, value in old.items():
      object.__setattr__(module, name, value)


def compact_state(module: nn.Module, method_name: Any) -> tuple[tuple[str, int], ...] | None:
  """The autoname counters of a bound module called inside its own compact method.

  A method called from the module's compact method (a helper such as
  `nn.WeightNorm._l2_normalize`) runs in that method's state (`Module._state`): it may
  make parameters and submodules, named on from the counters. None when the module is
  not inside a compact method, or when the call is a compact method's own start (Flax
  has set the flag for it, and no name is taken yet).
  """
  try:
    state = module._state
    inside, cursor = state.in_compact_method, state.autoname_cursor
  except AttributeError as e:
    raise unsupported("flax.linen.Module._state (in_compact_method, autoname_cursor)") from e
  if not inside:
    return None
  method = getattr(type(module), method_name, None) if isinstance(method_name, str) else None
  if not cursor and hasattr(method, "compact"):
    return None
  return tuple(sorted(cursor.items()))


def enter_compact_state(module: nn.Module, cursor: tuple[tuple[str, int], ...]) -> None:
  """Makes a bound module run as inside its compact method, with `cursor`'s counters."""
  try:
    state = module._state
  except AttributeError as e:
    raise unsupported("flax.linen.Module._state") from e
  state.in_compact_method = True
  state.autoname_cursor = dict(cursor)


def lifted_function_body(module: nn.Module, method_name: Any) -> bool:
  """Whether a call named `method_name` is not a method of the module's class.

  Flax's lifted transforms applied to a plain function (`nn.map_variables(fn, ...)
  (module)`, as `nn.WeightNorm` and `nn.SpectralNorm` do; `nn.vmap(fn)`, ...) call the
  function as a method of `module` (`lift_direct_transform`, `wrap_method_once`), named
  after the function.
  """
  return isinstance(method_name, str) and not callable(getattr(type(module), method_name, None))


def module_variables(module: nn.Module) -> dict[str, Any]:
  """A snapshot of the variables a bound module sees (its own and its children's).

  Inside a lifted transform these are the per-iteration (or per-member) values.
  """
  return unfreeze(module.variables)


def held_elsewhere(module: nn.Module) -> list[tuple[tuple[str, ...], nn.Module]]:
  """The modules a bound module holds in attributes but Flax bound outside of it.

  A module passed in as an attribute but bound elsewhere (the cell of
  `nn.RNN(nn.LSTMCell(4))` written in a parent's compact method lives in that parent; a
  module made in a parent's `setup` and handed to a sibling) keeps its scope where it is
  bound. The module's unbound clone adopts it under the attribute's name instead
  (Flax's `Module._register_submodules`); each is returned with that path in the clone
  (at any depth: a module held by an adopted one). The paths are read from the clone
  bound to an empty scope, so Flax's adoption rules (container suffixes, shared
  instances, `preserve_adopted_names`) apply as they are. A held module whose scope
  lies where the clone adopts it anyway (under an ancestor placed so) is left out.
  """
  placed = [(module_path(module), ())]  # (where bound, where in the clone) of each root
  found: list[tuple[tuple[str, ...], nn.Module]] = []
  seen: set[int] = set()

  def walk(original: nn.Module, clone: nn.Module) -> None:
    for held, adopted in zip(attribute_modules(original), attribute_modules(clone), strict=True):
      if id(held) in seen:
        continue
      seen.add(id(held))
      path, where = module_path(held), module_path(adopted)
      if not any(path[: len(p)] == p and where == w + path[len(p) :] for p, w in placed):
        placed.append((path, where))
        found.append((where, held))
      walk(held, adopted)

  walk(module, unbound_clone(module).bind({}))
  return found


def call_variables(
  module: nn.Module, held: list[tuple[tuple[str, ...], nn.Module]] | None = None
) -> dict[str, Any]:
  """The variables a bound module's call uses, keyed as in its `unbound_clone`.

  `module_variables` holds what lives under the module's own scope; the variables of
  the modules it holds but Flax bound elsewhere (`held_elsewhere`, computed unless
  given) are added under the paths its clone adopts them at.
  """
  variables = module_variables(module)
  for where, other in held_elsewhere(module) if held is None else held:
    for collection, tree in module_variables(other).items():
      target = variables.setdefault(collection, {})
      for name in where[:-1]:
        target = target.setdefault(name, {})
      target[where[-1]] = tree
  return variables


def adoption_paths(module: nn.Module) -> dict[tuple[str, ...], nn.Module]:
  """`{path in the clone: held module}` for the modules an unbound module holds.

  The modules are `module`'s own attribute values (at any depth), which
  `Module.clone(_deep_clone=...)` looks up by their `_id`; the paths are where Flax
  adopts them when `module` is bound (as in `held_elsewhere`).
  """
  paths: dict[tuple[str, ...], nn.Module] = {}
  seen: set[int] = set()

  def walk(unbound: nn.Module, bound: nn.Module) -> None:
    for held, adopted in zip(attribute_modules(unbound), attribute_modules(bound), strict=True):
      if id(held) not in seen:
        seen.add(id(held))
        paths.setdefault(module_path(adopted), held)
        walk(held, adopted)

  walk(module, module.bind({}))
  return paths


def attribute_modules(module: nn.Module) -> list[nn.Module]:
  """The modules held in a module's dataclass fields, in Flax's registration order."""
  held = []
  for field in dataclasses.fields(module):
    if field.init and field.name not in ("parent", "name"):
      leaves = jax.tree_util.tree_leaves(
        getattr(module, field.name), is_leaf=lambda x: isinstance(x, nn.Module)
      )
      held.extend(x for x in leaves if isinstance(x, nn.Module))
  return held


def capture_filter(capture_intermediates: Any) -> Callable[[nn.Module, str], bool] | None:
  """The filter Flax applies for `capture_intermediates=` (None when off)."""
  if capture_intermediates is True:
    return CAPTURE_CALL_INTERMEDIATES()
  return capture_intermediates or None


def is_setup_check(module: nn.Module) -> bool:
  """Whether this call is Flax's setup validation of a lifted module, not a real call.

  Lifted transforms validate `setup` on a throwaway clone bound to a `TestScope` at
  every apply; the interceptor sees it as a call of a method named `<lambda>`.
  """
  return isinstance(module.scope, TEST_SCOPE())


def intercepted_function(context: Any) -> Any:
  """The function a call reported to a Linen method interceptor runs, or None if unknown.

  `context` is the interceptor's `nn.module.InterceptorContext`; its `orig_method` is the
  method bound to the module (a `functools.partial` of the function in the Flax versions
  supported). Two bodies of one lifted transform named alike (two lambdas given to
  `nn.switch`) are told apart by it.
  """
  return getattr(getattr(context, "orig_method", None), "func", None)


def reported_method_name(method: Any) -> str | None:
  """The method name Linen's interceptor reports when `apply` calls `method`, or None.

  `apply(method="decode")` and `apply(method=Model.decode)` both report the call as
  `decode`: Flax wraps every module method (`wrap_method_once`, which marks the wrapper
  `method_handler_wrapped`) and names it by the wrapped function. A lambda or a plain
  function taking the module is not intercepted; only the calls it makes are.
  """
  if isinstance(method, str):
    return method
  if inspect.ismethod(method):
    method = method.__func__
  if not getattr(method, "method_handler_wrapped", False):
    return None
  return GET_FN_NAME()(getattr(method, "__wrapped__", method))
