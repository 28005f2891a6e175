"""`nnx.fori_loop`'s body wrapper, whose calls a run watches while it is active.

Checked with flax 0.12.6–0.12.8. In graph mode with graph updates (NNX's default),
`nnx.fori_loop` wraps the loop body in one `flax.nnx.transforms.iteration.ForiLoopBodyFn`
and traces that object twice: under `jax.eval_shape`, to read the carry's structure (the
values are dropped), then in `jax.lax.fori_loop`. While a run is active its `__call__` is
replaced in place (see `patching.patched`), so that the run sees each trace of the body
start and can give the calls of the second trace the keys of the first: one call per
module call in the body, as the model runs it, not a copy whose edits would be dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flaxlens._compat import Internal
from flaxlens._compat.patching import patched

FORI_LOOP_BODY_CALL = Internal("flax.nnx.transforms.iteration", "ForiLoopBodyFn.__call__")

_loops_local = threading.local()


def _body_call(original: Callable[..., Any]) -> Callable[..., Any]:
  def call(self: Any, *args: Any, **kwargs: Any) -> Any:
    handlers = getattr(_loops_local, "handlers", None)
    if not handlers:
      return original(self, *args, **kwargs)
    return handlers[-1](self, lambda: original(self, *args, **kwargs))

  return call


@contextmanager
def body_traces(handler: Callable[[Any, Callable[[], Any]], Any]) -> Iterator[None]:
  """While active in this thread, each trace of an `nnx.fori_loop` body runs as
  `handler(body, trace)`: `body` the wrapper object (the same object for every trace of
  one loop's body), `trace()` the trace itself."""
  if not hasattr(_loops_local, "handlers"):
    _loops_local.handlers = []
  _loops_local.handlers.append(handler)
  try:
    with patched({FORI_LOOP_BODY_CALL.site(): _body_call}):
      yield
  finally:
    _loops_local.handlers.pop()
