"""A copy of Linen's `Module.apply`, and its parameter shape check done once per initializer.

Checked with flax 0.12.6–0.12.8. `apply_fresh` mirrors `Module.apply`
(`flax.linen.module.Module._module_checks`, `_get_unbound_fn`, `_context.capture_stack`,
`flax.core.scope._is_valid_rng`, `union_filters`, `flax.core.apply`) and can start the
root scope from a recorded rng state, bind held modules where they were bound
(`Scope.push`, `Module.clone(_deep_clone=cache)`, keyed by `Module._id`) and run a
method inside a compact method's state. `param_checks_once` replaces
`flax.core.scope.Scope.param` in place while a conversion runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import core as flax_core
from flax import errors as flax_errors
from flax.core import meta as flax_meta

from flaxlens._compat import Internal, linen_modules, linen_rngs
from flaxlens._compat.patching import patched
from flaxlens.errors import ArgumentError, FlaxlensError

MODULE_CHECKS = Internal("flax.linen.module", "Module._module_checks")
GET_UNBOUND_FN = Internal("flax.linen.module", "_get_unbound_fn")
LINEN_CONTEXT = Internal("flax.linen.module", "_context")
IS_VALID_RNG = Internal("flax.core.scope", "_is_valid_rng")
UNION_FILTERS = Internal("flax.core.scope", "union_filters")
SCOPE_PARAM = Internal("flax.core.scope", "Scope.param")


def apply_fresh(
  module: nn.Module,
  variables: Mapping[str, Any],
  *args: Any,
  rngs: Any = None,
  method: str | Callable[..., Any] | None = None,
  mutable: Any = False,
  capture_intermediates: bool | Callable[..., bool] = False,
  rng_snapshot: linen_rngs.RngSnapshot | None = None,
  adopted: tuple[tuple[tuple[str, ...], str, Any], ...] = (),
  compact_cursor: tuple[tuple[str, int], ...] | None = None,
  **kwargs: Any,
) -> Any:
  """`module.apply(...)` whose lifted-transform caches cannot skip the interceptor.

  With `rng_snapshot` (from `linen_rngs.rng_snapshot` of a module inside a larger
  apply), the root scope starts from that rng state instead of `rngs`, so the module
  draws exactly the keys it drew inside the larger model. With `adopted` (see
  `bound_adopted`), the modules it held but Flax had bound elsewhere are bound as they
  were there, with their own names and rng states. With `compact_cursor` (see
  `linen_modules.compact_state`), the method runs as inside a compact method of the
  module, with those autoname counters.

  Inside a flaxlens run, `nn.jit` keys its traces on the run (see
  `linen_lift.jit_keys`), not on a per-apply flag, so unchanged trees reuse their
  traces. Everything else mirrors `Module.apply` in flax 0.12.8.
  """
  MODULE_CHECKS()(module)
  counters = None
  if rng_snapshot is not None:
    keys, suffixes, counters = rng_snapshot
    rngs = linen_rngs.lazy_rngs(keys, suffixes)
  if rngs is not None and not isinstance(rngs, dict):
    if not IS_VALID_RNG()(rngs):
      raise ArgumentError(
        f"{type(module).__name__}: the random streams must be a dict of JAX keys or one"
        f" key (as Flax's apply takes rngs=), got {rngs!r}. Pass for example"
        " {'dropout': jax.random.key(0)}."
      )
    rngs = {"params": rngs}
  if isinstance(method, str):
    name = method
    method = getattr(module, name)
    if isinstance(method, nn.Module):
      method = lambda self, *a, **k: getattr(self, name)(*a, **k)
  elif method is None:
    method = module.__call__
  method = GET_UNBOUND_FN()(method)
  capture_intermediates = linen_modules.capture_filter(capture_intermediates) or False
  if capture_intermediates:
    mutable = UNION_FILTERS()(mutable, "intermediates")
  context = LINEN_CONTEXT()

  def scope_fn(scope: Any, *a: Any, **k: Any) -> Any:
    if counters is not None:
      linen_rngs.restore_counters(scope, counters)
    context.capture_stack.append(capture_intermediates)
    try:
      deep = bound_adopted(module, scope, adopted) if adopted else True
      bound = module.clone(parent=scope, _deep_clone=deep)
      if compact_cursor is not None:
        linen_modules.enter_compact_state(bound, compact_cursor)
      return method(bound, *a, **k)
    finally:
      context.capture_stack.pop()

  return flax_core.apply(scope_fn, mutable=mutable)(variables, *args, rngs=rngs, **kwargs)


def bound_adopted(module: nn.Module, root: Any, adopted: Any) -> dict[Any, nn.Module]:
  """Binds the held modules of `adopted` as they were bound in the model; a clone cache.

  `adopted` holds `(path, name, rng)` per module the call held but Flax had bound
  elsewhere: `path` where `module`'s clone adopts it, `name` its own name, `rng` its
  scope's `(keys, suffixes, counters)` when the call started (None: derive as Flax
  does). Each is bound, under that name, to a scope pushed from `root` at `path` (the
  modules on the way there too, under the names Flax gives them), whose rng state is
  set to `rng`: so the module names what it makes as it did (`nn.WeightNorm` names its
  scales after its layer) and draws the keys it drew. Returned as the cache that
  `Module.clone(_deep_clone=cache)` uses for the held modules (keyed by `_id`).
  """
  targets = {tuple(path): (name, rng) for path, name, rng in adopted}
  held = linen_modules.adoption_paths(module)
  chain = sorted({p[:end] for p in targets for end in range(1, len(p) + 1)}, key=len)
  scopes = {(): root}
  for path in chain:
    if path not in held:
      raise FlaxlensError(
        f"{type(module).__name__}: the call held a module bound elsewhere in its model,"
        f" adopted at {'/'.join(path)!r}, but this module holds none there. Keep the"
        " modules a call holds as they were isolated (edit settings only)."
      )
    parent = scopes[path[:-1]]
    scope = scopes[path] = parent.push(path[-1])
    rng = targets.get(path, (None, None))[1]
    if rng is not None:
      linen_rngs.restore_pushed(parent, scope, path[-1], rng)
  cache: dict[Any, nn.Module] = {}
  for path in reversed(chain):  # Innermost first: a module binds what it holds at once.
    name = targets[path][0] if path in targets else path[-1]
    cache[held[path]._id] = held[path].clone(parent=scopes[path], name=name, _deep_clone=cache)
  return cache


# --- checking each distinct initializer once per conversion ------------------------------
#
# For a parameter that exists, `Scope.param` (flax 0.12.8, `flax.core.scope`, the
# `has_variable` branch) reserves the name, reads the value (unboxed unless
# `unbox=False`), evaluates `init_fn(jax.random.key(0), *init_args, **init_kwargs)` under
# `jax.eval_shape` and raises `errors.ScopeParamShapeError(name, scope.path_text, given,
# expected)` for the first leaf whose shape differs. The expected shapes depend only on
# `init_fn` and its arguments, so while a conversion runs they are computed once per
# distinct `(init_fn, arguments)`; the comparison and the error stay Flax's, at every
# call. A call whose arguments cannot be keyed (arrays, dicts, tracers) or whose
# parameter does not exist yet runs Flax's own `Scope.param`.

_param_local = threading.local()


def _static_key(value: Any) -> Any:
  """A key equal for two values only if they have the same types and equal contents.

  Raises:
    TypeError: for a value that cannot be keyed (unhashable, such as an array).
  """
  if type(value) in (tuple, list):
    return (type(value), tuple(_static_key(v) for v in value))
  hash(value)
  return (type(value), value)


def _checking_once(original: Callable[..., Any]) -> Callable[..., Any]:
  def param(
    self: Any,
    name: str,
    init_fn: Callable[..., Any],
    *init_args: Any,
    unbox: bool = True,
    **init_kwargs: Any,
  ) -> Any:
    expected = getattr(_param_local, "expected", None)
    if expected is None or not isinstance(name, str) or not self.has_variable("params", name):
      return original(self, name, init_fn, *init_args, unbox=unbox, **init_kwargs)
    try:
      key = (id(init_fn), _static_key(init_args), _static_key(tuple(init_kwargs.items())))
      shapes = expected.get(key)
    except Exception:  # Arguments that cannot be keyed (arrays, tracers, dicts).
      return original(self, name, init_fn, *init_args, unbox=unbox, **init_kwargs)
    self.reserve(name, "params")
    value = self.get_variable("params", name)
    if unbox:
      value = flax_meta.unbox(value)
    if shapes is None:
      abstract = jax.eval_shape(lambda: init_fn(jax.random.key(0), *init_args, **init_kwargs))
      shapes = [np.shape(leaf) for leaf in jax.tree_util.tree_leaves(abstract)]
      expected[key] = shapes
      _param_local.held.append(init_fn)  # Its id stays unique while the cache lives.
    for leaf, shape in zip(jax.tree_util.tree_leaves(value), shapes, strict=False):
      if np.shape(leaf) != shape:
        raise flax_errors.ScopeParamShapeError(name, self.path_text, np.shape(leaf), shape)
    return value

  return param


@contextmanager
def param_checks_once() -> Iterator[None]:
  """While active in this thread, `Scope.param` checks each distinct initializer once."""
  outer = getattr(_param_local, "expected", None), getattr(_param_local, "held", None)
  _param_local.expected, _param_local.held = {}, []
  try:
    with patched({SCOPE_PARAM.site(): _checking_once}):
      yield
  finally:
    _param_local.expected, _param_local.held = outer
