"""`nnx.jit`'s wrapper classes, whose calls a run takes over while it is active.

Checked with flax 0.12.1–0.12.8. `nnx.jit` returns a
`flax.nnx.transforms.compilation.JitWrapped` (from flax 0.12.6, a `SimpleJitWrapped` for
`graph=False` or `graph_updates=False`), whose `fun` is the function it wraps, and
caches its trace on the `GraphDef`s of its arguments. While a run is active their
`__call__` is replaced in place (see `patching.patched`) so that the run can put the
jitted call's key into the site attributes of the modules passed, or run the function
inline. Whether a wrapper donates its arguments is read from its `jitted_fn` (a
`jax.jit` function): the `donate_argnums`/`donate_argnames` of its `_jit_info` (checked
with jax 0.10).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flaxlens._compat import Internal
from flaxlens._compat.patching import patched

JIT_WRAPPED_CALL = Internal("flax.nnx.transforms.compilation", "JitWrapped.__call__")
SIMPLE_JIT_WRAPPED_CALL = Internal(
  "flax.nnx.transforms.compilation", "SimpleJitWrapped.__call__", added_in="flax 0.12.6"
)

_nnx_local = threading.local()


def _nnx_jit_call(original: Callable[..., Any]) -> Callable[..., Any]:
  def call(self: Any, *args: Any, **kwargs: Any) -> Any:
    handlers = getattr(_nnx_local, "handlers", None)
    if not handlers:
      return original(self, *args, **kwargs)
    return handlers[-1](
      lambda: original(self, *args, **kwargs),
      (args, kwargs),
      lambda: self.fun(*args, **kwargs),
      donates(self),
    )

  return call


def donates(wrapper: Any) -> bool:
  """Whether an `nnx.jit` wrapper donates any of its arguments' buffers.

  True when it cannot tell (an unknown wrapper), so that callers stay on the safe side.
  """
  info = getattr(getattr(wrapper, "jitted_fn", None), "_jit_info", None)
  if info is None or not hasattr(info, "donate_argnums"):
    return True
  return bool(info.donate_argnums) or bool(getattr(info, "donate_argnames", ()))


@contextmanager
def jit_keys(handler: Callable[..., Any]) -> Iterator[None]:
  """While active in this thread, `nnx.jit` calls run as
  `handler(call, arguments, inline, donates)`.

  `inline()` calls the function `nnx.jit` wraps (its `fun`) directly, untraced;
  `donates` says whether the jitted function donates any of its arguments.
  """
  replacements = {JIT_WRAPPED_CALL.site(): _nnx_jit_call}
  if SIMPLE_JIT_WRAPPED_CALL.or_none() is not None:  # None: a release without it.
    replacements[SIMPLE_JIT_WRAPPED_CALL.site()] = _nnx_jit_call
  if not hasattr(_nnx_local, "handlers"):
    _nnx_local.handlers = []
  _nnx_local.handlers.append(handler)
  try:
    with patched(replacements):
      yield
  finally:
    _nnx_local.handlers.pop()
