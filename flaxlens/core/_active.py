"""Which interceptor the framework hooks report to: a per-thread stack of active runs.

A run (or a conversion) makes its interceptor active for the duration of the native
call; hooks and call nodes look it up here. Runs nest (a replacement may call another
tree), so this is a stack, one per thread. No Flax internals here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_local = threading.local()


def current_interceptor() -> Any:
  """The innermost active interceptor of this thread, or None."""
  stack = getattr(_local, "stack", None)
  return stack[-1] if stack else None


def is_active(interceptor: Any) -> bool:
  """Whether `interceptor` is active in this thread (innermost or not)."""
  return interceptor in getattr(_local, "stack", ())


@contextmanager
def activated(interceptor: Any) -> Iterator[None]:
  """Makes `interceptor` the innermost active one while the block runs."""
  if not hasattr(_local, "stack"):
    _local.stack = []
  _local.stack.append(interceptor)
  try:
    yield
  finally:
    _local.stack.remove(interceptor)
