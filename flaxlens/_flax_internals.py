"""Every use of Flax internals in flaxlens, in one place.

Checked against flax 0.12.8 (jax 0.10.2). Linen: the method-interceptor hook
(`flax.linen.module.intercept_methods`, public but thin), collection filters
(`flax.core.scope.in_filter`), module paths (`Module.scope.path`), unbound clones
(`Module.clone(_deep_clone=..., _reset_names=...)`), the per-scope rng counters
(`Scope.rng_counters`), the `TestScope` that Flax's setup check runs lifted modules on,
and a copy of `Module.apply` that can set root `Scope.flags` (`flax.core.apply(flags=)`,
`flax.linen.module._get_unbound_fn`, `_context.capture_stack`). A Flax upgrade that
changes any of these should break here only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
from flax import core as flax_core
from flax.core import scope as flax_scope
from flax.linen import module as linen_module

_apply_nonce = itertools.count()


def in_collection_filter(filter_like: Any, collection: str) -> bool:
  """Whether `collection` is selected by a Flax `mutable=`-style filter."""
  return flax_scope.in_filter(filter_like, collection)


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


def rng_counts(module: nn.Module) -> dict[str, int]:
  """How many keys the module's scope has drawn from each rng stream so far.

  Lifted transforms also keep nested counter dicts in `rng_counters`; those are skipped.
  """
  return {k: v for k, v in module.scope.rng_counters.items() if isinstance(v, int)}


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
  **kwargs: Any,
) -> Any:
  """`module.apply(...)` whose lifted-transform caches cannot skip the interceptor.

  `nn.jit` caches its trace on a fingerprint of the module that includes the root
  scope's `flags`; a module-level `nn.jit` class would otherwise reuse a trace made
  without (or with another) interceptor and skip every call inside it. A fresh flag
  per apply forces a new trace; flags are read by Flax only for `initializing`.
  Everything else mirrors `Module.apply` in flax 0.12.8.
  """
  linen_module.Module._module_checks(module)
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
    linen_module._context.capture_stack.append(capture_intermediates)
    try:
      return method(module.clone(parent=scope, _deep_clone=True), *a, **k)
    finally:
      linen_module._context.capture_stack.pop()

  flags = {"flaxlens_apply": next(_apply_nonce)}
  return flax_core.apply(scope_fn, mutable=mutable, flags=flags)(
    variables, *args, rngs=rngs, **kwargs
  )
