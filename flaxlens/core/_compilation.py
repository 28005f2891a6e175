"""Compiling less: JAX's persistent compilation cache, and counting what a block compiles.

`enable_compilation_cache` points JAX's persistent cache at a per-user folder (or the one
given, or `$FLAXLENS_COMPILATION_CACHE`) and lets it keep small programs too, so a second
process asking the same question reads the compiled program instead of compiling it.
`import flaxlens` never does this (a library does not change JAX's global settings on
its own); the `flaxlens` command line does. `count_compiles` counts, with
`jax.monitoring` listeners, the traces, XLA compilations and cache reads made while a
block runs. The event names and the cache reset are JAX internals, in
`_compat/compilation.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator
from typing import Any

import jax

from flaxlens._compat import compilation

ENVIRONMENT = "FLAXLENS_COMPILATION_CACHE"
_OFF = frozenset({"0", "off", "false", "no", "none"})
_lock = threading.Lock()
_set_by_us: list[str] = []  # The folder this module set, if it set one.
_THRESHOLDS = (
  "jax_persistent_cache_min_compile_time_secs",
  "jax_persistent_cache_min_entry_size_bytes",
)
_before: dict[str, Any] = {}  # JAX's settings before this module first changed them.


def default_cache_folder() -> str:
  """The per-user folder: `$XDG_CACHE_HOME/flaxlens/jax`, else `~/.cache/flaxlens/jax`."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "flaxlens", "jax")


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
  """Keeps compiled programs on disk, so another process skips compiling them.

  Sets JAX's persistent compilation cache (`jax_compilation_cache_dir`) to `path` and
  lets it keep every program, however quick to compile or small
  (`jax_persistent_cache_min_compile_time_secs=0`,
  `jax_persistent_cache_min_entry_size_bytes=0`). A later process that traces the same
  program (same model structure, shapes, sites and metric code) reads it instead of
  compiling it; tracing still runs. Without `path`: the folder
  `$FLAXLENS_COMPILATION_CACHE` names, or the per-user default
  (`$XDG_CACHE_HOME/flaxlens/jax`, else `~/.cache/flaxlens/jax`); that variable set to
  `0` or `off` disables it. A folder you already gave JAX yourself is kept, with your
  thresholds. `import flaxlens` never calls this; the `flaxlens` command line does.

  The cache is trusted: whoever can write to the folder can make your process run
  code, so keep it private to you (it is created readable by you alone).

  Args:
    path: the folder, or None for the environment variable or the default.

  Returns:
    The folder JAX's cache uses now, or None if it was disabled by the environment.

  Example:
    >>> import flaxlens as fl, jax, tempfile
    >>> folder = fl.enable_compilation_cache(tempfile.mkdtemp())
    >>> jax.config.jax_compilation_cache_dir == folder
    True
    >>> fl.disable_compilation_cache()
  """
  if path is None:
    chosen = os.environ.get(ENVIRONMENT, "").strip()
    if chosen.lower() in _OFF:
      return None
    if not chosen:
      current = jax.config.jax_compilation_cache_dir
      if current and current not in _set_by_us:  # The user's own folder.
        return current
    folder = os.path.abspath(os.path.expanduser(chosen or default_cache_folder()))
  else:
    folder = os.path.abspath(os.path.expanduser(os.fspath(path)))
  with _lock:
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if not _before:
      _before.update({k: jax.config.values[k] for k in ("jax_compilation_cache_dir", *_THRESHOLDS)})
    if jax.config.jax_compilation_cache_dir != folder:
      jax.config.update("jax_compilation_cache_dir", folder)
      compilation.reset_cache()
    for name in _THRESHOLDS:
      jax.config.update(name, 0)
    _set_by_us[:] = [folder]
  return folder


def disable_compilation_cache() -> None:
  """Undoes `enable_compilation_cache`: JAX's cache settings are as they were before it.

  Example:
    >>> import flaxlens as fl, jax, tempfile
    >>> before = jax.config.jax_compilation_cache_dir
    >>> _ = fl.enable_compilation_cache(tempfile.mkdtemp())
    >>> fl.disable_compilation_cache()
    >>> jax.config.jax_compilation_cache_dir == before
    True
  """
  with _lock:
    if not _before:
      return
    for name, value in _before.items():
      jax.config.update(name, value)
    _before.clear()
    _set_by_us.clear()
    compilation.reset_cache()


@dataclasses.dataclass
class CompileCount:
  """What JAX traced and compiled while a `count_compiles` block ran (so far).

  Attributes:
    traces: programs traced to be compiled (top-level `jax.jit` traces: a flaxlens run,
      sweep or attribution is one; a jitted `jax.numpy` function called eagerly too).
    requests: XLA compilations asked for, each compiled or read from the persistent cache.
    cache_hits: those read from the persistent compilation cache.

  Example:
    >>> import flaxlens as fl
    >>> count = fl.CompileCount(traces=1, requests=2, cache_hits=1)
    >>> count.compilations
    1
  """

  traces: int = 0
  requests: int = 0
  cache_hits: int = 0

  @property
  def compilations(self) -> int:
    """XLA compilations that ran (requests not answered by the persistent cache)."""
    return self.requests - self.cache_hits


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCount]:
  """Counts the traces and compilations JAX makes while the block runs.

  Counts everything compiled in the process meanwhile, other threads included. Eager
  `jax.numpy` calls compile small programs of their own, once per shape; keep them out
  of the block to count a tool's programs alone.

  Yields:
    A `CompileCount`, updated as JAX traces and compiles.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> scalings = [fl.scale(nn.Dense, float(alpha)) for alpha in range(5)]
    >>> with fl.count_compiles() as count:
    ...   for scaling in scalings:
    ...     _ = fl.run(tree, x, interventions=[scaling])
    >>> count.traces, count.requests
    (1, 1)
  """
  count = CompileCount()

  def on_event(event: str, **_: Any) -> None:
    if event == compilation.CACHE_HIT_EVENT:
      count.cache_hits += 1

  def on_duration(event: str, duration: float, **_: Any) -> None:
    if event == compilation.TRACE_EVENT:
      count.traces += 1
    elif event == compilation.COMPILE_EVENT:
      count.requests += 1

  jax.monitoring.register_event_listener(on_event)
  jax.monitoring.register_event_duration_secs_listener(on_duration)
  try:
    yield count
  finally:
    compilation.UNREGISTER_EVENT_LISTENER()(on_event)
    compilation.UNREGISTER_DURATION_LISTENER()(on_duration)
