"""Every use of a Flax or JAX internal in flaxlens, one module per concern.

flaxlens reads and wraps parts of Flax and JAX that are not public API: Linen's scopes
and lifted transforms, NNX's graph and jit wrappers, JAX's trace state. Each module here
holds one concern and declares what it touches as `Internal`s at its top; an `Internal`
is looked up when first used, never at import, so `import flaxlens` works whatever
Flax and JAX are installed, and the first use of an internal they lack raises
`UnsupportedFlaxFeatureError` naming it and the versions flaxlens supports (`SUPPORTED`,
kept equal to the window in pyproject.toml). Nothing outside this package may use an
internal (`tests/project/test_architecture.py` checks it); docs/compat.md lists every one.

- `linen_modules`: paths, clones, adoption of held modules, compact-method state,
  setup checks and method names of Linen modules.
- `linen_rngs`: the rng state of a Linen scope (`LazyRng`, rng counters).
- `linen_apply`: a copy of `Module.apply`, and the parameter shape check done once.
- `linen_lift`: where a Linen lifted call starts, and `nn.jit`'s cache key.
- `nnx_graph`: NNX's graph: flatten and merge, static attributes, the site attribute.
- `nnx_variables`: an NNX `Variable`'s slots and NNX's variable-type registry.
- `nnx_jit`: `nnx.jit`'s wrapper classes.
- `nnx_attention`: NNX's attention-weights function.
- `pytrees`: rebuilding a JAX pytree definition from its nodes.
- `tracing`: JAX's current trace, and whether it stages for compilation.
- `patching`: methods and functions replaced in place while a run is active.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, NamedTuple

from flaxlens.errors import UnsupportedFlaxFeatureError

# The versions flaxlens is tested with; pyproject.toml's dependencies say the same (each
# Flax release installs with the JAX releases it accepts: flax 0.12.0 is the only one to
# accept jax 0.7, flax 0.12.7 and 0.12.8 need jax 0.10).
SUPPORTED = "flax 0.12.x with jax 0.7.1–0.10.x"
INSTALL = "pip install 'flax>=0.12.0,<0.13' 'jax>=0.7.1,<0.11' 'jaxlib>=0.7.1,<0.11'"


def _installed_versions() -> str:
  """The installed Flax and JAX versions, as `"flax X with jax Y"`."""
  versions = []
  for package in ("flax", "jax"):
    try:
      versions.append(f"{package} {importlib.import_module(package).__version__}")
    except Exception:  # A package that cannot even be imported says so.
      versions.append(f"{package} (not importable)")
  return " with ".join(versions)


def unsupported(name: str) -> UnsupportedFlaxFeatureError:
  """The error for an internal the installed Flax or JAX lacks (or has changed)."""
  return UnsupportedFlaxFeatureError(
    f"flaxlens uses {name}, which the installed {_installed_versions()} does not have:"
    f" flaxlens supports {SUPPORTED}. Install versions in that window ({INSTALL})."
  )


class Formerly(NamedTuple):
  """Where older Flax or JAX releases kept an internal under another module or name.

  `versions` says which releases (for docs/compat.md and the reader), e.g.
  `"flax 0.12.0–0.12.4"`.
  """

  module: str
  name: str
  versions: str


class Internal:
  """One Flax or JAX internal: `name` (dotted: an attribute of an attribute) of `module`.

  Calling it returns the object, imported and looked up on the first call and kept;
  where the installed release lacks it, each of `formerly` (where older releases kept
  it) is tried in turn, and a lookup that fails in all of them raises
  `UnsupportedFlaxFeatureError` (see `unsupported`), at that call and at every later one.
  `added_in` (e.g. `"flax 0.12.6"`): the first release that has it, for internals that
  older releases lack altogether; `or_none` gives None on those.

  Example:
    >>> from flaxlens._compat import Formerly, Internal
    >>> Internal("flax.core.scope", "LazyRng")().__name__
    'LazyRng'
    >>> Internal(
    ...   "flax.nnx.no_such_module", "GraphDef",
    ...   formerly=(Formerly("flax.nnx", "GraphDef", "every release"),),
    ... )().__name__
    'GraphDef'
  """

  __slots__ = ("module", "name", "formerly", "added_in", "_value", "_site")

  def __init__(
    self, module: str, name: str, *, formerly: tuple[Formerly, ...] = (), added_in: str = ""
  ):
    self.module = module
    self.name = name
    self.formerly = formerly
    self.added_in = added_in
    self._value: Any = _MISSING
    self._site: tuple[Any, str] | None = None
    DECLARED.append(self)

  def __repr__(self) -> str:
    return f"Internal({self.module!r}, {self.name!r})"

  @property
  def full_name(self) -> str:
    return f"{self.module}.{self.name}"

  def __call__(self) -> Any:
    value = self._value
    if value is _MISSING:
      error: Exception | None = None
      for module, name in ((self.module, self.name), *((f.module, f.name) for f in self.formerly)):
        try:
          owner = importlib.import_module(module)
          *path, last = name.split(".")
          for part in path:
            owner = getattr(owner, part)
          value = getattr(owner, last)
        except (ImportError, AttributeError) as e:
          error = error or e
          continue
        self._value, self._site = value, (owner, last)
        return value
      raise unsupported(self.full_name) from error
    return value

  def or_none(self) -> Any:
    """The object, or None where the installed release predates `added_in`.

    A release from `added_in` on that lacks it still raises, as calling it does.
    """
    if self.added_in and _installed_before(self.added_in):
      return None
    return self()

  def site(self) -> tuple[Any, str]:
    """`(owner, name)`: the module or class that holds this internal, and its last name.

    What `patching.patched` takes to replace it in place; checked to exist first.
    """
    self()
    assert self._site is not None
    return self._site

  def resolved(self) -> bool:
    """Whether this internal has been looked up (successfully) already."""
    return self._value is not _MISSING


def _installed_before(release: str) -> bool:
  """Whether the installed package is older than `release` (`"flax 0.12.6"`)."""
  package, version = release.split(" ")
  return _numbers(importlib.import_module(package).__version__) < _numbers(version)


def _numbers(version: str) -> tuple[int, ...]:
  """The leading release numbers of a version string: `"0.12.6.dev1"` -> `(0, 12, 6)`."""
  return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


_MISSING = object()
DECLARED: list[Internal] = []  # Every `Internal` made, in the order the modules made them.
