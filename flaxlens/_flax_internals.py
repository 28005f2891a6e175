"""Every use of Flax internals in flaxlens, in one place.

Checked against flax 0.12.8 (jax 0.10.2). Linen: the method-interceptor hook
(`flax.linen.module.intercept_methods`, public but thin), module paths
(`Module.scope.path`), unbound clones (`Module.clone(_deep_clone=..., _reset_names=...)`),
the per-scope rng counters
(`Scope.rng_counters`), the `TestScope` that Flax's setup check runs lifted modules on,
and a copy of `Module.apply` that can set root `Scope.flags` (`flax.core.apply(flags=)`,
`flax.linen.module._get_unbound_fn`, `_context.capture_stack`). NNX: the private
`_pytree__is_pytree` flag and the `PytreeMeta` class keywords needed to subclass a module
class, swapping an instance's `__class__`, a `_pytree__`-prefixed instance attribute that
rides in the `GraphDef` as static data, `GraphDef.num_leaves`, and the base classes
whose methods are Flax's own (see the NNX section below). A Flax upgrade that changes
any of these should break here only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
from flax import core as flax_core
from flax.core import scope as flax_scope
from flax.linen import module as linen_module

_apply_nonce = itertools.count()


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


def rng_snapshot(module: nn.Module) -> tuple[dict[str, Any], dict[str, tuple], dict]:
  """The rng state of a bound module's scope: `(keys, suffixes, counters)`.

  A scope holds one `LazyRng` per stream (a key plus a static suffix of names folded in
  lazily) and `rng_counters`: how many keys it has drawn per stream, plus the counter
  dicts of the child scopes it has pushed (keyed `(child_rng_token, name)`, reused when
  a child is pushed again). Restoring all three reproduces `make_rng` exactly.
  """
  keys, suffixes = {}, {}
  for name, rng in module.scope.rngs.items():
    keys[name] = rng.rng if isinstance(rng, flax_scope.LazyRng) else rng
    suffixes[name] = tuple(rng.suffix) if isinstance(rng, flax_scope.LazyRng) else ()
  return keys, suffixes, _copy_counters(module.scope.rng_counters)


def module_variables(module: nn.Module) -> dict[str, Any]:
  """A snapshot of the variables a bound module sees (its own and its children's).

  Inside a lifted transform these are the per-iteration (or per-member) values.
  """
  from flax.core import unfreeze

  return unfreeze(module.variables)


def capture_filter(capture_intermediates: Any) -> Callable[[nn.Module, str], bool] | None:
  """The filter Flax applies for `capture_intermediates=` (None when off)."""
  if capture_intermediates is True:
    return linen_module.capture_call_intermediates
  return capture_intermediates or None


def counters_to_data(counters: dict) -> list:
  """Scope rng counters as JSON-able data: `[[name, count] | ["child", name, [...]]]`."""
  data = []
  for key, value in counters.items():
    if isinstance(key, tuple) and key and key[0] is flax_scope.child_rng_token:
      data.append(["child", key[1], counters_to_data(value)])
    else:
      data.append([key, value])
  return data


def counters_from_data(data: list) -> dict:
  """Inverse of `counters_to_data`."""
  counters: dict = {}
  for entry in data:
    if entry[0] == "child" and len(entry) == 3:
      counters[(flax_scope.child_rng_token, entry[1])] = counters_from_data(entry[2])
    else:
      counters[entry[0]] = entry[1]
  return counters


def _copy_counters(counters: dict) -> dict:
  token = flax_scope.child_rng_token
  return copy.deepcopy(counters, memo={id(token): token})


intercept_methods = nn.intercept_methods


def is_setup_check(module: nn.Module) -> bool:
  """Whether this call is Flax's setup validation of a lifted module, not a real call.

  Lifted transforms validate `setup` on a throwaway clone bound to a `TestScope` at
  every apply; the interceptor sees it as a call of a method named `<lambda>`.
  """
  return isinstance(module.scope, linen_module.TestScope)


def apply_fresh(
  module: nn.Module,
  variables: Mapping[str, Any],
  *args: Any,
  rngs: Any = None,
  method: str | Callable[..., Any] | None = None,
  mutable: Any = False,
  capture_intermediates: bool | Callable[..., bool] = False,
  rng_snapshot: tuple[dict[str, Any], dict[str, tuple], dict] | None = None,
  **kwargs: Any,
) -> Any:
  """`module.apply(...)` whose lifted-transform caches cannot skip the interceptor.

  With `rng_snapshot` (from `rng_snapshot()` of a module inside a larger apply), the
  root scope starts from that rng state instead of `rngs`, so the module draws exactly
  the keys it drew inside the larger model.

  `nn.jit` caches its trace on a fingerprint of the module that includes the root
  scope's `flags`; a module-level `nn.jit` class would otherwise reuse a trace made
  without (or with another) interceptor and skip every call inside it. A fresh flag
  per apply forces a new trace; flags are read by Flax only for `initializing`.
  Everything else mirrors `Module.apply` in flax 0.12.8.
  """
  linen_module.Module._module_checks(module)
  counters = None
  if rng_snapshot is not None:
    keys, suffixes, counters = rng_snapshot
    rngs = {n: flax_scope.LazyRng(keys[n], tuple(suffixes[n])) for n in keys}
  if rngs is not None and not isinstance(rngs, dict):
    if not flax_scope._is_valid_rng(rngs):
      raise TypeError(f"rngs must be a dict of JAX keys or one key, got {rngs!r}.")
    rngs = {"params": rngs}
  if isinstance(method, str):
    name = method
    method = getattr(module, name)
    if isinstance(method, nn.Module):
      method = lambda self, *a, **k: getattr(self, name)(*a, **k)
  elif method is None:
    method = module.__call__
  method = linen_module._get_unbound_fn(method)
  if capture_intermediates is True:
    capture_intermediates = linen_module.capture_call_intermediates
  if capture_intermediates:
    mutable = flax_scope.union_filters(mutable, "intermediates")

  def scope_fn(scope: Any, *a: Any, **k: Any) -> Any:
    if counters is not None:
      scope.rng_counters = _copy_counters(counters)
    linen_module._context.capture_stack.append(capture_intermediates)
    try:
      return method(module.clone(parent=scope, _deep_clone=True), *a, **k)
    finally:
      linen_module._context.capture_stack.pop()

  flags = {"flaxlens_apply": next(_apply_nonce)}
  return flax_core.apply(scope_fn, mutable=mutable, flags=flags)(
    variables, *args, rngs=rngs, **kwargs
  )


# --- NNX -------------------------------------------------------------------------------
#
# NNX has no interception hook (flax issue 4666). flaxlens swaps the class of every
# module instance of a private copy of the model for a cached subclass whose methods
# report to an interceptor. What makes that work in flax 0.12.8:
# - `Pytree._graph_node_flatten` records `type(self)` as the node type, so `nnx.split`
#   / `nnx.merge` inside `nnx.scan`, `nnx.vmap`, `nnx.remat` and `nnx.jit` re-create
#   the instrumented subclass, and `GraphDef` equality (jit cache keys) follows it.
# - Instance attributes that are not data ride in the `GraphDef` as static values, so a
#   module re-created inside a transform still knows its path. The attribute name
#   starts with `_pytree__`: NNX's reprs skip such names and `nnx.bridge.ToNNX` does
#   not mistake it for a Linen collection.
# - `nnx.jit` (through `jax.jit`) caches its trace on the `GraphDef`; a trace made in
#   an earlier call would skip the interceptor. The site attribute carries a nonce that
#   is new for every run, so each run traces afresh.
# - `nnx.capture(method_outputs=...)` wraps only the methods found in `type(m).__dict__`
#   (not inherited ones); the instrumented subclass keeps that set unchanged by
#   defining wrappers of inherited methods on a mixin base instead (`nnx_subclass`).
# - Attributes whose names start with `_pytree__` are NNX's bookkeeping, not the
#   module's settings; the conversion's check for changed static attributes skips them.

NNX_SITE_ATTRIBUTE = "_pytree__flaxlens_site"


def nnx_flax_bases() -> tuple[type, ...]:
  """Classes whose methods are NNX's own machinery (or container API), not layer calls."""
  from flax import nnx
  from flax.nnx import reprlib

  return (
    nnx.Module,
    nnx.Pytree,
    nnx.Object,
    nnx.List,
    nnx.Dict,
    reprlib.Representable,
    reprlib.SequenceReprMixin,
    reprlib.MappingReprMixin,
  )


def nnx_subclass(cls: type, mixin_methods: dict[str, Any], namespace: dict[str, Any]) -> type:
  """A subclass of the NNX module class `cls`, registered with NNX and JAX as `cls` is.

  `mixin_methods` go on a mixin base placed before `cls` in the MRO. For an instance's
  `__class__` to be swappable, CPython requires the mixin to have the instance layout
  of `cls` and the same base as the class that introduced that layout (`nnx.Pytree`,
  which adds `__dict__`/`__weakref__` to the slot-less `reprlib.Representable`).
  """
  bases: tuple[type, ...] = (cls,)
  if mixin_methods:
    layout = next(k for k in reversed(cls.__mro__) if k.__dictoffset__ != 0)
    name = f"{cls.__name__}InheritedMethods"
    bases = (type(name, (layout.__base__,), mixin_methods), cls)
  return type(cls)(cls.__name__, bases, namespace, pytree=cls._pytree__is_pytree)


def nnx_swap_class(module: Any, cls: type) -> None:
  """Makes `module` an instance of `cls` (a subclass of its class, same layout)."""
  object.__setattr__(module, "__class__", cls)


def nnx_set_site(module: Any, site: Any) -> None:
  """Stores `site` on `module` as a static attribute (it bypasses `Pytree.__setattr__`)."""
  object.__setattr__(module, NNX_SITE_ATTRIBUTE, site)


def nnx_clear_site(module: Any) -> None:
  """Removes the site stored by `nnx_set_site`, if any."""
  vars(module).pop(NNX_SITE_ATTRIBUTE, None)


def nnx_site(module: Any) -> Any:
  """The site stored by `nnx_set_site`, or None."""
  return vars(module).get(NNX_SITE_ATTRIBUTE)


def nnx_static_attributes(module: Any) -> dict[str, Any]:
  """The module's own static attributes, as its `GraphDef` records them.

  A pytree module (the default) keeps which attributes are data in `_pytree__nodes`,
  set when they are assigned (`nnx.data(...)` marks a dict of variables as data, as
  `nnx.bridge.ToNNX` does for Linen collections); other modules' attributes are data
  when `graphlib` flattens them as nodes or leaves. NNX's `_pytree__` bookkeeping is
  left out.
  """
  from flax import nnx
  from flax.nnx import graphlib

  nodes = module._pytree__nodes if module._pytree__is_pytree else None
  static = {}
  for name, value in vars(module).items():
    if name.startswith("_pytree__"):
      continue
    if nodes is not None:
      data = nodes.get(name, False)
    else:
      data = graphlib.get_node_impl(value) is not None or nnx.is_data(value)
    if not data:
      static[name] = value
  return static


def nnx_set_static(module: Any, name: str, value: Any) -> None:
  """Sets a static attribute of an NNX module, leaving its data/static record unchanged."""
  object.__setattr__(module, name, value)


def nnx_leaf_count(graphdef: Any) -> int:
  """How many variables `nnx.merge(graphdef, leaves)` takes (`GraphDef.num_leaves`)."""
  return graphdef.num_leaves


def nnx_variable_mode(variable: Any) -> str | None:
  """`"ref"` or `"hijax"` if the NNX variable lives in that mode, else None."""
  metadata = variable.get_metadata()
  for mode in ("ref", "hijax"):
    if metadata.get(mode):
      return mode
  return None
