"""Methods and functions of Flax, JAX and user classes, replaced in place while a run is active.

Checked with flax 0.12.6–0.12.8 and jax 0.10.x. Replacing `owner.name` in `vars(owner)`
is how flaxlens hooks into code that has no hook of its own (NNX method calls, Linen's
lift, `nnx.jit`'s wrappers, JAX's `lax` transforms). Every replacement is
reference-counted across nested and concurrent runs and put back, as the identical
object, when the last run leaves; the wrappers themselves fall through to the original
for calls that are not part of a run of their thread. No internal is read here: the
owners and names are the callers' (see the modules that call `patched`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_patch_lock = threading.Lock()
_patches: dict[tuple[int, str], list[Any]] = {}  # (id(owner), name) -> [original, count]


@contextmanager
def patched(replacements: Mapping[tuple[Any, str], Callable[[Any], Any]]) -> Iterator[None]:
  """Sets `owner.name = make(original)` for each `(owner, name): make` while active.

  Reference-counted across nested and concurrent runs (the first wrapper installed
  stays until the last user leaves), and restored to the very object that was in
  `vars(owner)` in `finally`. The wrappers must fall through to the original for
  calls that are not part of a run of this thread.
  """
  done: list[tuple[Any, str]] = []
  try:
    with _patch_lock:
      for (owner, name), make in replacements.items():
        entry = _patches.get((id(owner), name))
        if entry is None:
          original = vars(owner)[name]
          entry = _patches[(id(owner), name)] = [original, 0]
          setattr(owner, name, make(original))
        entry[1] += 1
        done.append((owner, name))
    yield
  finally:
    with _patch_lock:
      for owner, name in reversed(done):
        entry = _patches[(id(owner), name)]
        entry[1] -= 1
        if entry[1] == 0:
          setattr(owner, name, entry[0])
          del _patches[(id(owner), name)]
