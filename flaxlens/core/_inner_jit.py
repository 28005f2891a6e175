"""Cache keys for a framework's jit (`nn.jit`, `nnx.jit`) met inside a tree run.

An inner jit traces its body once per cache key and replays the trace afterwards, so
whatever flaxlens does while the body is traced (which calls are replaced, by which
layers, with which constants and side inputs, who observes) is baked into that trace.
flaxlens adds a key of its own to the framework's cache key: a `RunToken`, equal for two
runs exactly when their traces compute the same thing, and the position of the jitted
call in the run, so every application of a jitted method (weight tying) traces on its
own. Variables the run passes to Flax are traced inputs of the jit and are left out of
the token: editing a parameter never retraces.

The token is derived from the tree's structure (its treedef, static fields included),
the identity of every leaf that is not such a variable (arrays held by replacement
layers become trace constants) and the side inputs, and is held in a bounded cache that
keeps those leaves alive, so no id can be reused while its token lives; an evicted
token is never handed out again. A trace replayed from the cache runs no Python, so the
calls it would have reported are replayed on the caller's frame from what the first
trace recorded. No Flax internals here.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax

from flaxlens.core._variables import AbstractVariable

_tokens = itertools.count()
_lock = threading.Lock()
_MAX_TOKENS = 64
# (treedef, leaf keys) -> (token, leaves kept alive); least recently used first.
_by_key: OrderedDict[Any, tuple[int, list[Any]]] = OrderedDict()
# token -> {position: (names of the calls the traced body reported in its caller's frame,
#                      names of the probed calls it reached)}
_effects: dict[int, dict[Any, tuple[tuple[str, ...], tuple[str, ...]]]] = {}
_VALUES = (int, float, complex, bool, str, bytes, type(None))


def _token_for(run: Any, traced: frozenset[int]) -> int:
  leaves, treedef = jax.tree_util.tree_flatten(run)
  parts: list[Any] = []
  held: list[Any] = []
  for leaf in leaves:
    if isinstance(leaf, AbstractVariable):
      if id(leaf) in traced:
        parts.append(None)
        continue
      leaf = leaf.value
    if type(leaf) in _VALUES:
      parts.append((type(leaf), leaf))
    else:
      parts.append(id(leaf))
      held.append(leaf)
  key = (treedef, tuple(parts))
  with _lock:
    try:
      entry = _by_key.get(key)
    except TypeError:  # An unhashable static field: this run's traces are its own.
      return _new_token()
    if entry is None:
      entry = _by_key[key] = (_new_token(), held)
      while len(_by_key) > _MAX_TOKENS:
        old, _ = _by_key.popitem(last=False)[1]
        _effects.pop(old, None)
    _by_key.move_to_end(key)
    return entry[0]


def _new_token() -> int:
  token = next(_tokens)
  _effects[token] = {}
  return token


def _unique_token() -> int:
  return next(_tokens)


class RunToken:
  """What the traces made during one run bake in, as a hashable cache-key part.

  Computed on first use (only runs that meet an inner jit pay for it) from
  `run = (tree, side_inputs)`, with the variables whose ids are in `traced` (those the
  run passes to the framework) left out. `RunToken.unique(...)` never equals another
  token: for conversion and for runs that observe (their traces call back into them).

  Attributes:
    interceptor: the run's interceptor (a weak reference is kept).
  """

  __slots__ = ("_run", "_traced", "_value", "_interceptor", "_own", "__weakref__")

  def __init__(self, interceptor: Any, run: Any = None, traced: frozenset[int] = frozenset()):
    self._interceptor = weakref.ref(interceptor)
    self._run = run
    self._traced = traced
    self._value: int | None = None
    self._own: dict[Any, tuple[tuple[str, ...], tuple[str, ...]]] | None = None

  @classmethod
  def unique(cls, interceptor: Any) -> RunToken:
    token = cls(interceptor)
    token._value, token._own = _unique_token(), {}
    return token

  @property
  def interceptor(self) -> Any:
    return self._interceptor()

  @property
  def value(self) -> int:
    if self._value is None:
      self._value = _token_for(self._run, self._traced)
      self._run = None
    return self._value

  def __hash__(self) -> int:
    return hash(self.value)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, RunToken) and self.value == other.value

  def __repr__(self) -> str:
    return f"RunToken({self.value})"


def _recorded(token: RunToken) -> dict[Any, tuple[tuple[str, ...], tuple[str, ...]]]:
  if token._own is not None:
    return token._own
  value = token.value
  with _lock:
    return _effects.get(value, {})  # Evicted: its traces will not be met again.


@contextmanager
def inner_jit(
  frame: Any,
  call_path: tuple[Any, ...],
  token: RunToken,
  trace: Any,
  reached: set[str] | None = None,
) -> Iterator[Any]:
  """Around one call of a framework's jit made in `frame`; yields the key to add.

  `trace` identifies the JAX trace the jitted call is made in: a second jitted call
  made in the same trace is a new call, not a transform's retrace of the last one.
  The key is `(token, call_path, position in the frame)`; if the framework replays a
  trace instead of tracing, the calls the body reported in `frame` when it was traced
  are numbered again, so later calls keep their keys, and the probed calls it reached
  (names added to `reached`, a run's `Probing.reached`) are reached again.
  """
  lifted = frame.lifted
  if lifted is not None and lifted[0] is not None and frame.jit_trace == trace:
    frame.lifted = None
  frame.jit_trace = trace
  position = (call_path, frame.counter, tuple(frame.lifted[:2]) if frame.lifted else None)
  outer_log, frame.log = frame.log, []
  before = set(reached) if reached is not None else set()
  try:
    yield (token, position)
  finally:
    reported, frame.log = tuple(frame.log), outer_log
  recorded = _recorded(token)
  if reported:
    probed = tuple(sorted(reached - before)) if reached is not None else ()
    recorded[position] = (reported, probed)
  else:
    reported, probed = recorded.get(position, ((), ()))
    for name in reported:
      key, _ = frame.next_key(name)
      frame.reached.add(key)
    if reached is not None:
      reached.update(probed)
  if outer_log is not None:
    outer_log.extend(reported)
