"""JAX's compilation events and its persistent compilation cache.

Checked with jax 0.10.0–0.10.2. The counts come from `jax.monitoring` listeners (public)
on events whose names are not API: a top-level trace records
`/jax/core/compile/jaxpr_trace_duration`, every XLA compilation request
`/jax/core/compile/backend_compile_duration` (around the persistent cache's lookup too),
a persistent cache read `/jax/compilation_cache/cache_hits`. `reset_cache` is
`jax._src.compilation_cache.reset_cache`: the cache folder is read once, when JAX first
compiles with one set, so moving it later needs the cache reset. jax 0.7.x has no public
way to unregister a listener: `jax._src.monitoring._unregister_event_listener_by_callback`
and `_unregister_event_duration_listener_by_callback` do it there (`Formerly` places).
"""

from __future__ import annotations

from flaxlens._compat import Formerly, Internal

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

RESET_CACHE = Internal("jax._src.compilation_cache", "reset_cache")
UNREGISTER_EVENT_LISTENER = Internal(
  "jax.monitoring",
  "unregister_event_listener",
  formerly=(
    Formerly("jax._src.monitoring", "_unregister_event_listener_by_callback", "jax 0.7.x"),
  ),
)
UNREGISTER_DURATION_LISTENER = Internal(
  "jax.monitoring",
  "unregister_event_duration_listener",
  formerly=(
    Formerly("jax._src.monitoring", "_unregister_event_duration_listener_by_callback", "jax 0.7.x"),
  ),
)


def reset_cache() -> None:
  """Makes JAX open the persistent cache folder again at its next compilation."""
  RESET_CACHE()()
