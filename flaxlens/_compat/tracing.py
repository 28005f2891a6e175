"""JAX's trace state: which trace calls are made in now, and what it traces for.

Checked with jax 0.8.1–0.10.2. `current_trace` is
`jax.extend.core.get_opaque_trace_state` (new in jax 0.10; `jax._src.core` had it
before, and it is looked up there then). `at_top_level` reads
`jax._src.core.trace_state_clean`, and `runs_compiled` walks the trace stack from
`jax._src.core.trace_ctx.trace` up `parent_trace`, asking each
`partial_eval.DynamicJaxprTrace` what it stages for (`frame.debug_info.traced_for`).
"""

from __future__ import annotations

from typing import Any

from flaxlens._compat import Formerly, Internal
from flaxlens.errors import UnsupportedFlaxFeatureError

GET_OPAQUE_TRACE_STATE = Internal(
  "jax.extend.core",
  "get_opaque_trace_state",
  formerly=(Formerly("jax._src.core", "get_opaque_trace_state", "jax 0.7.1–0.9.x"),),
)
TRACE_STATE_CLEAN = Internal("jax._src.core", "trace_state_clean")
TRACE_CONTEXT = Internal("jax._src.core", "trace_ctx")
DYNAMIC_JAXPR_TRACE = Internal("jax._src.interpreters.partial_eval", "DynamicJaxprTrace")

# Staging traces whose jaxpr the outermost eager caller evaluates op by op rather than
# compiling (`remat_p`'s impl is `core.eval_jaxpr`), by their `traced_for`.
_STAGED_BUT_EAGER = frozenset({"checkpoint / remat"})


def current_trace() -> Any:
  """The JAX trace calls are made in now (equal for two calls in the same trace)."""
  return GET_OPAQUE_TRACE_STATE()(convention="flaxlens")


def at_top_level() -> bool:
  """Whether no JAX transform is tracing now (an eager call: no jit, vmap, grad, ...).

  False where the installed JAX lacks the check, so that callers take their general
  path (this only decides whether a faster one may be taken).
  """
  try:
    clean = TRACE_STATE_CLEAN()
  except UnsupportedFlaxFeatureError:
    return False
  return bool(clean())


def runs_compiled() -> bool:
  """Whether the code being traced now runs as compiled XLA code when it executes.

  JAX stages a body into a jaxpr for `jit`, `scan`, `while_loop`, `fori_loop`, `cond`
  and `switch` (what `nn.jit`, `nn.scan`, `nnx.jit`, `nnx.scan` and the other compiling
  transforms build on) and compiles it, even when called eagerly; a checkpoint
  (`nn.remat`, `nnx.remat`) is staged too but evaluated op by op outside of those, and
  `vmap` or `grad` on their own run op by op.
  """
  staging = DYNAMIC_JAXPR_TRACE()
  trace = TRACE_CONTEXT().trace
  while trace is not None:
    if isinstance(trace, staging) and trace.frame.debug_info.traced_for not in _STAGED_BUT_EAGER:
      return True
    trace = getattr(trace, "parent_trace", None)
  return False
