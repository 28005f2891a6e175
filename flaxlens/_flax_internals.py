"""Every use of Flax internals in flaxlens, in one place.

Checked against flax 0.12.8 (jax 0.10.2). Linen: the method-interceptor hook
(`flax.linen.module.intercept_methods`, public but thin), module paths
(`Module.scope.path`), unbound clones (`Module.clone(_deep_clone=..., _reset_names=...)`)
and where they adopt modules held in attributes (`Module.bind`); binding the held
modules a model had bound elsewhere as they were there (`Module.clone(_deep_clone=cache)`
with a pre-filled cache, `Scope.push` and a pushed scope's `rngs` and `rng_counters`);
a module's compact-method state (`Module._state`: `in_compact_method`,
`autoname_cursor`); the function bodies of lifted transforms (`lift_direct_transform`);
the per-scope rng counters
(`Scope.rng_counters`), the `TestScope` that Flax's setup check runs lifted modules on,
where a lifted call starts (`flax.core.lift._partial_pack`), the name a root method
given as a function is intercepted under (`method_handler_wrapped`, `_get_fn_name`),
a copy of `Module.apply` (`flax.linen.module._get_unbound_fn`, `_context.capture_stack`),
`nn.jit`'s cache key (`flax.linen.transforms._HashableProxy`,
`flax.core.lift._restore_rng_counters`), and the parameter shape check of
`flax.core.scope.Scope.param`, done once per distinct initializer while converting
(`param_checks_once`). NNX: a `_pytree__`-prefixed instance attribute
that rides in the `GraphDef` as static data, `nnx.jit`'s wrapper classes
(`JitWrapped`, `SimpleJitWrapped`), `GraphDef.num_leaves`, the leaf order of
`nnx.graph.flatten`, the index map `graphlib.unflatten` fills while merging, a
`Variable`'s `_raw_value` and `_var_metadata` slots (refilling a kept private copy), and
the base classes whose methods are Flax's own (see the NNX section below). Methods of
Flax and user classes
are wrapped in place only while a run is active (`patched`). JAX: the current trace,
whether any trace is active (`at_top_level`), and what a staging trace traces for
(`runs_compiled`, jax 0.10.2). A Flax or JAX upgrade
that changes any of these should break here only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import core as flax_core
from flax import errors as flax_errors
from flax.core import lift as core_lift
from flax.core import meta as flax_meta
from flax.core import scope as flax_scope
from flax.linen import module as linen_module
from flax.linen import transforms as linen_transforms

from flaxlens.errors import ArgumentError, FlaxlensError


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


def compact_state(module: nn.Module, method_name: Any) -> tuple[tuple[str, int], ...] | None:
  """The autoname counters of a bound module called inside its own compact method.

  A method called from the module's compact method (a helper such as
  `nn.WeightNorm._l2_normalize`) runs in that method's state (`Module._state`): it may
  make parameters and submodules, named on from the counters. None when the module is
  not inside a compact method, or when the call is a compact method's own start (Flax
  has set the flag for it, and no name is taken yet).
  """
  state = module._state
  if not state.in_compact_method:
    return None
  method = getattr(type(module), method_name, None) if isinstance(method_name, str) else None
  if not state.autoname_cursor and hasattr(method, "compact"):
    return None
  return tuple(sorted(state.autoname_cursor.items()))


def lifted_function_body(module: nn.Module, method_name: Any) -> bool:
  """Whether a call named `method_name` is not a method of the module's class.

  Flax's lifted transforms applied to a plain function (`nn.map_variables(fn, ...)
  (module)`, as `nn.WeightNorm` and `nn.SpectralNorm` do; `nn.vmap(fn)`, ...) call the
  function as a method of `module` (`lift_direct_transform`, `wrap_method_once`), named
  after the function.
  """
  return isinstance(method_name, str) and not callable(getattr(type(module), method_name, None))


def module_variables(module: nn.Module) -> dict[str, Any]:
  """A snapshot of the variables a bound module sees (its own and its children's).

  Inside a lifted transform these are the per-iteration (or per-member) values.
  """
  from flax.core import unfreeze

  return unfreeze(module.variables)


def held_elsewhere(module: nn.Module) -> list[tuple[tuple[str, ...], nn.Module]]:
  """The modules a bound module holds in attributes but Flax bound outside of it.

  A module passed in as an attribute but bound elsewhere (the cell of
  `nn.RNN(nn.LSTMCell(4))` written in a parent's compact method lives in that parent; a
  module made in a parent's `setup` and handed to a sibling) keeps its scope where it is
  bound. The module's unbound clone adopts it under the attribute's name instead
  (Flax's `Module._register_submodules`); each is returned with that path in the clone
  (at any depth: a module held by an adopted one). The paths are read from the clone
  bound to an empty scope, so Flax's adoption rules (container suffixes, shared
  instances, `preserve_adopted_names`) apply as they are. A held module whose scope
  lies where the clone adopts it anyway (under an ancestor placed so) is left out.
  """
  placed = [(module_path(module), ())]  # (where bound, where in the clone) of each root
  found: list[tuple[tuple[str, ...], nn.Module]] = []
  seen: set[int] = set()

  def walk(original: nn.Module, clone: nn.Module) -> None:
    for held, adopted in zip(_attribute_modules(original), _attribute_modules(clone), strict=True):
      if id(held) in seen:
        continue
      seen.add(id(held))
      path, where = module_path(held), module_path(adopted)
      if not any(path[: len(p)] == p and where == w + path[len(p) :] for p, w in placed):
        placed.append((path, where))
        found.append((where, held))
      walk(held, adopted)

  walk(module, unbound_clone(module).bind({}))
  return found


def call_variables(
  module: nn.Module, held: list[tuple[tuple[str, ...], nn.Module]] | None = None
) -> dict[str, Any]:
  """The variables a bound module's call uses, keyed as in its `unbound_clone`.

  `module_variables` holds what lives under the module's own scope; the variables of
  the modules it holds but Flax bound elsewhere (`held_elsewhere`, computed unless
  given) are added under the paths its clone adopts them at.
  """
  variables = module_variables(module)
  for where, other in held_elsewhere(module) if held is None else held:
    for collection, tree in module_variables(other).items():
      target = variables.setdefault(collection, {})
      for name in where[:-1]:
        target = target.setdefault(name, {})
      target[where[-1]] = tree
  return variables


def _adoption_paths(module: nn.Module) -> dict[tuple[str, ...], nn.Module]:
  """`{path in the clone: held module}` for the modules an unbound module holds.

  The modules are `module`'s own attribute values (at any depth), which
  `Module.clone(_deep_clone=...)` looks up by their `_id`; the paths are where Flax
  adopts them when `module` is bound (as in `held_elsewhere`).
  """
  paths: dict[tuple[str, ...], nn.Module] = {}
  seen: set[int] = set()

  def walk(unbound: nn.Module, bound: nn.Module) -> None:
    for held, adopted in zip(_attribute_modules(unbound), _attribute_modules(bound), strict=True):
      if id(held) not in seen:
        seen.add(id(held))
        paths.setdefault(module_path(adopted), held)
        walk(held, adopted)

  walk(module, module.bind({}))
  return paths


def _bound_adopted(module: nn.Module, root: Any, adopted: Any) -> dict[Any, nn.Module]:
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
  held = _adoption_paths(module)
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
      keys, suffixes, counters = rng
      scope.rngs = {n: flax_scope.LazyRng(keys[n], tuple(suffixes[n])) for n in keys}
      scope.rng_counters = _copy_counters(counters)
      parent.rng_counters[(flax_scope.child_rng_token, path[-1])] = scope.rng_counters
  cache: dict[Any, nn.Module] = {}
  for path in reversed(chain):  # Innermost first: a module binds what it holds at once.
    name = targets[path][0] if path in targets else path[-1]
    cache[held[path]._id] = held[path].clone(parent=scopes[path], name=name, _deep_clone=cache)
  return cache


def _attribute_modules(module: nn.Module) -> list[nn.Module]:
  """The modules held in a module's dataclass fields, in Flax's registration order."""
  held = []
  for field in dataclasses.fields(module):
    if field.init and field.name not in ("parent", "name"):
      leaves = jax.tree_util.tree_leaves(
        getattr(module, field.name), is_leaf=lambda x: isinstance(x, nn.Module)
      )
      held.extend(x for x in leaves if isinstance(x, nn.Module))
  return held


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


# JAX's record of what is being traced now (`core.trace_ctx.trace`, each trace's
# `parent_trace`, and a staging trace's `frame.debug_info.traced_for`), jax 0.10.2.
# Staging traces whose jaxpr the outermost eager caller evaluates op by op rather than
# compiling (`remat_p`'s impl is `core.eval_jaxpr`).
_STAGED_BUT_EAGER = frozenset({"checkpoint / remat"})


def runs_compiled() -> bool:
  """Whether the code being traced now runs as compiled XLA code when it executes.

  JAX stages a body into a jaxpr for `jit`, `scan`, `while_loop`, `fori_loop`, `cond`
  and `switch` (what `nn.jit`, `nn.scan`, `nnx.jit`, `nnx.scan` and the other compiling
  transforms build on) and compiles it, even when called eagerly; a checkpoint
  (`nn.remat`, `nnx.remat`) is staged too but evaluated op by op outside of those, and
  `vmap` or `grad` on their own run op by op.
  """
  from jax._src import core as jax_core
  from jax._src.interpreters import partial_eval

  trace = jax_core.trace_ctx.trace
  while trace is not None:
    if isinstance(trace, partial_eval.DynamicJaxprTrace):
      if trace.frame.debug_info.traced_for not in _STAGED_BUT_EAGER:
        return True
    trace = getattr(trace, "parent_trace", None)
  return False


intercept_methods = nn.intercept_methods


def is_setup_check(module: nn.Module) -> bool:
  """Whether this call is Flax's setup validation of a lifted module, not a real call.

  Lifted transforms validate `setup` on a throwaway clone bound to a `TestScope` at
  every apply; the interceptor sees it as a call of a method named `<lambda>`.
  """
  return isinstance(module.scope, linen_module.TestScope)


def reported_method_name(method: Any) -> str | None:
  """The method name Linen's interceptor reports when `apply` calls `method`, or None.

  `apply(method="decode")` and `apply(method=Model.decode)` both report the call as
  `decode`: Flax wraps every module method (`wrap_method_once`, which marks the wrapper
  `method_handler_wrapped`) and names it by the wrapped function. A lambda or a plain
  function taking the module is not intercepted; only the calls it makes are.
  """
  if isinstance(method, str):
    return method
  if inspect.ismethod(method):
    method = method.__func__
  if not getattr(method, "method_handler_wrapped", False):
    return None
  return linen_module._get_fn_name(getattr(method, "__wrapped__", method))


def apply_fresh(
  module: nn.Module,
  variables: Mapping[str, Any],
  *args: Any,
  rngs: Any = None,
  method: str | Callable[..., Any] | None = None,
  mutable: Any = False,
  capture_intermediates: bool | Callable[..., bool] = False,
  rng_snapshot: tuple[dict[str, Any], dict[str, tuple], dict] | None = None,
  adopted: tuple[tuple[tuple[str, ...], str, Any], ...] = (),
  compact_cursor: tuple[tuple[str, int], ...] | None = None,
  **kwargs: Any,
) -> Any:
  """`module.apply(...)` whose lifted-transform caches cannot skip the interceptor.

  With `rng_snapshot` (from `rng_snapshot()` of a module inside a larger apply), the
  root scope starts from that rng state instead of `rngs`, so the module draws exactly
  the keys it drew inside the larger model. With `adopted` (see `_bound_adopted`), the
  modules it held but Flax had bound elsewhere are bound as they were there, with
  their own names and rng states. With `compact_cursor` (see `compact_state`), the
  method runs as inside a compact method of the module, with those autoname counters.

  Inside a flaxlens run, `nn.jit` keys its traces on the run (see `linen_jit_keys`),
  not on a per-apply flag, so unchanged trees reuse their traces. Everything else
  mirrors `Module.apply` in flax 0.12.8.
  """
  linen_module.Module._module_checks(module)
  counters = None
  if rng_snapshot is not None:
    keys, suffixes, counters = rng_snapshot
    rngs = {n: flax_scope.LazyRng(keys[n], tuple(suffixes[n])) for n in keys}
  if rngs is not None and not isinstance(rngs, dict):
    if not flax_scope._is_valid_rng(rngs):
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
      deep = _bound_adopted(module, scope, adopted) if adopted else True
      bound = module.clone(parent=scope, _deep_clone=deep)
      if compact_cursor is not None:
        bound._state.in_compact_method = True
        bound._state.autoname_cursor = dict(compact_cursor)
      return method(bound, *a, **k)
    finally:
      linen_module._context.capture_stack.pop()

  return flax_core.apply(scope_fn, mutable=mutable)(variables, *args, rngs=rngs, **kwargs)


# --- patching Flax and user classes while a run is active ------------------------------

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


# --- Linen: checking each distinct initializer once per conversion ----------------------
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
    with patched({(flax_scope.Scope, "param"): _checking_once}):
      yield
  finally:
    _param_local.expected, _param_local.held = outer


def current_trace() -> Any:
  """The JAX trace calls are made in now (equal for two calls in the same trace)."""
  import jax.extend

  return jax.extend.core.get_opaque_trace_state(convention="flax")


# --- Linen: keying nn.jit traces on the run ----------------------------------------------
#
# `nn.jit` (flax 0.12.8, `flax.linen.transforms`) keys its `jax.jit` cache on a
# `_HashableProxy` of the module, made by `_HashableProxy.from_module(self)` right before
# the lifted call, and `flax.core.lift.jit` calls `_restore_rng_counters(scopes,
# fingerprint, ...)` right after it, with the proxy as `fingerprint[1]`. Both are looked
# up as module globals at call time; while a Linen run is active they are replaced by
# versions that add the run's key to the proxy and report the end of the call.

_linen_local = threading.local()
_HashableProxy = linen_transforms._HashableProxy


class _KeyedProxy(_HashableProxy):
  """Flax's module proxy, with flaxlens's key (None outside runs) in hash and equality."""

  @classmethod
  def from_module(cls, module: Any) -> Any:
    base = _HashableProxy.from_module(module)
    proxy = cls(base.module_ref, base.hash_key)
    handlers = getattr(_linen_local, "handlers", None)
    key = handlers[-1][0]() if handlers else None
    object.__setattr__(proxy, "flaxlens_key", key)
    return proxy

  def __hash__(self) -> int:
    return hash((self.hash_key, getattr(self, "flaxlens_key", None)))

  def __eq__(self, other: object) -> bool:
    return (
      isinstance(other, _HashableProxy)
      and self.hash_key == other.hash_key
      and getattr(self, "flaxlens_key", None) == getattr(other, "flaxlens_key", None)
    )


def _restore_rng_counters(original: Callable[..., Any]) -> Callable[..., Any]:
  def restore(scopes: Any, fingerprint: Any, capture_old_counts: Any) -> Any:
    result = original(scopes, fingerprint, capture_old_counts)
    if getattr(fingerprint[1], "flaxlens_key", None) is not None:
      _linen_local.handlers[-1][1]()
    return result

  return restore


@contextmanager
def linen_jit_keys(start: Callable[[], Any], finish: Callable[[], None]) -> Iterator[None]:
  """While active in this thread, `nn.jit` calls add `start()` to their cache key.

  `finish()` is called when such a call returns (not when it raises).
  """
  replacements = {
    (linen_transforms, "_HashableProxy"): lambda _: _KeyedProxy,
    (core_lift, "_restore_rng_counters"): _restore_rng_counters,
  }
  if not hasattr(_linen_local, "handlers"):
    _linen_local.handlers = []
  _linen_local.handlers.append((start, finish))
  try:
    with patched(replacements):
      yield
  finally:
    _linen_local.handlers.pop()


# --- Linen: where a lifted call starts ----------------------------------------------------
#
# Every Linen lifted transform (`nn.scan`, `nn.vmap`, `nn.remat`, `nn.jit`, ..., applied to
# a class, as a method decorator or to a function) runs through a wrapper made by
# `flax.core.lift.pack` (flax 0.12.8), which calls `_partial_pack` once per invocation,
# before the transform traces its body (once, or twice for `nn.scan`: a shape pass and the
# loop). `_partial_pack` is a module global looked up at call time; while a Linen run is
# active in this thread it first calls the run's `announce()`.


def _announcing(original: Callable[..., Any]) -> Callable[..., Any]:
  def partial_pack(*args: Any, **kwargs: Any) -> Any:
    handlers = getattr(_linen_local, "lifted", None)
    if handlers:
      handlers[-1]()
    return original(*args, **kwargs)

  return partial_pack


@contextmanager
def linen_lifted_calls(announce: Callable[[], None]) -> Iterator[None]:
  """While active in this thread, `announce()` runs as each Linen lifted call starts."""
  if not hasattr(_linen_local, "lifted"):
    _linen_local.lifted = []
  _linen_local.lifted.append(announce)
  try:
    with patched({(core_lift, "_partial_pack"): _announcing}):
      yield
  finally:
    _linen_local.lifted.pop()


# --- NNX -------------------------------------------------------------------------------
#
# NNX has no interception hook (flax issue 4666). While a tree runs, flaxlens wraps, in
# place, the methods of the model's classes (in the `__dict__` of the class that defines
# each one, see `patched`); a wrapper reports a call only for module instances of a
# private copy of the model, which carry a site attribute. What makes that work in
# flax 0.12.8:
# - Instance attributes that are not data ride in the `GraphDef` as static values, so a
#   module re-created inside `nnx.scan`, `nnx.vmap`, `nnx.remat` or `nnx.jit` still
#   knows its path and run. The attribute name starts with `_pytree__`: NNX's reprs
#   skip such names and `nnx.bridge.ToNNX` does not mistake it for a Linen collection.
# - `nnx.jit` (`JitWrapped`, and `SimpleJitWrapped` for `graph=False` or
#   `graph_updates=False`) caches its trace on the `GraphDef`s of its arguments. While a
#   run is active their `__call__` is wrapped so that the run can put the jitted call's
#   key into the site attributes of the modules passed (see `nnx_jit_keys`).
# - `nnx.capture(method_outputs=...)` wraps the methods found in `type(m).__dict__`;
#   wrapping in place keeps that set unchanged.
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


def nnx_set_site(module: Any, site: Any) -> None:
  """Stores `site` on `module` as a static attribute (it bypasses `Pytree.__setattr__`)."""
  object.__setattr__(module, NNX_SITE_ATTRIBUTE, site)


def nnx_clear_site(module: Any) -> None:
  """Removes the site stored by `nnx_set_site`, if any."""
  vars(module).pop(NNX_SITE_ATTRIBUTE, None)


def nnx_site(module: Any) -> Any:
  """The site stored by `nnx_set_site`, or None."""
  return vars(module).get(NNX_SITE_ATTRIBUTE)


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
    )

  return call


@contextmanager
def nnx_jit_keys(handler: Callable[[Callable[[], Any], Any], Any]) -> Iterator[None]:
  """While active in this thread, `nnx.jit` calls run as `handler(call, arguments, inline)`.

  `inline()` calls the function `nnx.jit` wraps (its `fun`) directly, untraced.
  """
  from flax.nnx.transforms import compilation

  replacements = {
    (compilation.JitWrapped, "__call__"): _nnx_jit_call,
    (compilation.SimpleJitWrapped, "__call__"): _nnx_jit_call,
  }
  if not hasattr(_nnx_local, "handlers"):
    _nnx_local.handlers = []
  _nnx_local.handlers.append(handler)
  try:
    with patched(replacements):
      yield
  finally:
    _nnx_local.handlers.pop()


def nnx_flatten(module: Any) -> tuple[Any, list[tuple[tuple[Any, ...], Any]]]:
  """`nnx.split(module)`'s `GraphDef` and `(path, variable)` pairs, in the order that
  `nnx.merge(graphdef, leaves)` takes a list of leaves.

  `nnx.graph.flatten` is what `nnx.split` runs first; its leaves come in the graph's
  traversal order, the order `GraphDef.num_leaves` counts and a list is merged in.
  """
  from flax import nnx

  graphdef, flat = nnx.graph.flatten(module)
  return graphdef, [(tuple(path), variable) for path, variable in flat]


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


def nnx_merge_indexed(graphdef: Any, leaves: list[Any]) -> tuple[Any, Mapping[int, Any]]:
  """`nnx.merge(graphdef, leaves)`, and the objects it made by their `GraphDef` index.

  `nnx.merge` of a list calls `graphlib.unflatten` with a fresh `IndexMap`, into which
  it puts every graph node (module, `nnx.Rngs`, ...) and variable it creates under the
  node's index; passing that map in keeps it. Empty for a tree-mode `GraphDef`, which
  has no indices.
  """
  from flax.nnx import graphlib

  made = graphlib.IndexMap()
  return graphlib.unflatten(graphdef, leaves, index_ref=made), made


def nnx_set_raw_value(variable: Any, value: Any) -> None:
  """Sets an NNX variable's value without NNX's trace-level check.

  flax 0.12.8 keeps the value in the `Variable` slot `_raw_value`; `set_raw_value`
  first checks that the current trace is the one the variable was made in (about a
  microsecond a variable). Only for variables made in the current trace.
  """
  object.__setattr__(variable, "_raw_value", value)


def nnx_variable_metadata(variable: Any) -> dict[str, Any]:
  """An NNX variable's own metadata dict (not a copy: `get_metadata` copies it)."""
  return variable._var_metadata


def at_top_level() -> bool:
  """Whether no JAX transform is tracing now (an eager call: no jit, vmap, grad, ...).

  jax 0.10's `trace_state_clean`; False where it is missing, so that callers fall
  back to their general path.
  """
  try:
    from jax._src import core
  except ImportError:  # pragma: no cover - depends on the installed JAX
    return False
  clean = getattr(core, "trace_state_clean", None)
  return bool(clean()) if clean is not None else False


def nnx_is_graph_container(value: Any) -> bool:
  """Whether NNX traverses `value` as a node of the graph (module, list, dict, ...)."""
  from flax.nnx import graphlib

  return graphlib.is_node(value)


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


def nnx_collection_name(variable_type: type) -> str:
  """The collection an NNX variable type belongs to, as `nnx.bridge` names it.

  The name NNX's registry (`nnx.register_variable_name`) gives the exact type
  (`batch_stats` for `nnx.BatchStat`, `cache` for `nnx.Cache`), else the type's class
  name, which is what `variable_name_from_type(..., allow_register=True)` would register
  for it (without registering it here). Checked against Flax 0.12.8's
  `variablelib.VariableTypeCache`.
  """
  from flax.nnx import variablelib

  for name, registered in variablelib.VariableTypeCache.items():
    if registered is variable_type:
      return name
  return variable_type.__name__
