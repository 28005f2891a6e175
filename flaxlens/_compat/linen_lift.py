"""Linen's lifted transforms: where a lifted call starts, and the key of `nn.jit`'s cache.

Checked with flax 0.12.6–0.12.8. Both hooks replace a module global of Flax that is
looked up at call time, in place, only while a Linen run is active in some thread (see
`patching.patched`); the replacements fall through to Flax's own for other threads.

- Every lifted transform (`nn.scan`, `nn.vmap`, `nn.remat`, `nn.jit`, ..., applied to a
  class, as a method decorator or to a function) runs through a wrapper made by
  `flax.core.lift.pack`, which calls `flax.core.lift._partial_pack` once per invocation,
  before the transform traces its body (once, or twice for `nn.scan`: a shape pass and
  the loop).
- `nn.jit` keys its `jax.jit` cache on a `flax.linen.transforms._HashableProxy` of the
  module (`_HashableProxy.from_module(self)`, fields `module_ref` and `hash_key`), made
  right before the lifted call; `flax.core.lift.jit` calls
  `flax.core.lift._restore_rng_counters(scopes, fingerprint, ...)` right after it, with
  the proxy as `fingerprint[1]`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flaxlens._compat import Internal
from flaxlens._compat.patching import patched

PARTIAL_PACK = Internal("flax.core.lift", "_partial_pack")
RESTORE_RNG_COUNTERS = Internal("flax.core.lift", "_restore_rng_counters")
HASHABLE_PROXY = Internal("flax.linen.transforms", "_HashableProxy")

_linen_local = threading.local()


@functools.cache
def _keyed_proxy() -> type:
  """Flax's module proxy, with flaxlens's key (None outside runs) in hash and equality."""
  base_class = HASHABLE_PROXY()

  class KeyedProxy(base_class):
    @classmethod
    def from_module(cls, module: Any) -> Any:
      base = base_class.from_module(module)
      proxy = cls(base.module_ref, base.hash_key)
      handlers = getattr(_linen_local, "handlers", None)
      key = handlers[-1][0]() if handlers else None
      object.__setattr__(proxy, "flaxlens_key", key)
      return proxy

    def __hash__(self) -> int:
      return hash((self.hash_key, getattr(self, "flaxlens_key", None)))

    def __eq__(self, other: object) -> bool:
      return (
        isinstance(other, base_class)
        and self.hash_key == other.hash_key
        and getattr(self, "flaxlens_key", None) == getattr(other, "flaxlens_key", None)
      )

  return KeyedProxy


def _restore_rng_counters(original: Callable[..., Any]) -> Callable[..., Any]:
  def restore(scopes: Any, fingerprint: Any, capture_old_counts: Any) -> Any:
    result = original(scopes, fingerprint, capture_old_counts)
    if getattr(fingerprint[1], "flaxlens_key", None) is not None:
      _linen_local.handlers[-1][1]()
    return result

  return restore


@contextmanager
def jit_keys(start: Callable[[], Any], finish: Callable[[], None]) -> Iterator[None]:
  """While active in this thread, `nn.jit` calls add `start()` to their cache key.

  `finish()` is called when such a call returns (not when it raises).
  """
  replacements = {
    HASHABLE_PROXY.site(): lambda _: _keyed_proxy(),
    RESTORE_RNG_COUNTERS.site(): _restore_rng_counters,
  }
  if not hasattr(_linen_local, "handlers"):
    _linen_local.handlers = []
  _linen_local.handlers.append((start, finish))
  try:
    with patched(replacements):
      yield
  finally:
    _linen_local.handlers.pop()


def _announcing(original: Callable[..., Any]) -> Callable[..., Any]:
  def partial_pack(*args: Any, **kwargs: Any) -> Any:
    handlers = getattr(_linen_local, "lifted", None)
    if handlers:
      handlers[-1]()
    return original(*args, **kwargs)

  return partial_pack


@contextmanager
def lifted_calls(announce: Callable[[], None]) -> Iterator[None]:
  """While active in this thread, `announce()` runs as each Linen lifted call starts."""
  replacements = {PARTIAL_PACK.site(): _announcing}
  if not hasattr(_linen_local, "lifted"):
    _linen_local.lifted = []
  _linen_local.lifted.append(announce)
  try:
    with patched(replacements):
      yield
  finally:
    _linen_local.lifted.pop()
