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
- `tracing`: JAX's current trace, and whether it stages for compilation.
- `patching`: methods and functions replaced in place while a run is active.
"""

from __future__ import annotations

import importlib
from typing import Any

from flaxlens.errors import UnsupportedFlaxFeatureError

# The versions flaxlens is tested with; pyproject.toml's dependencies say the same.
SUPPORTED = "flax 0.12.6–0.12.x with jax 0.10.x"
INSTALL = "pip install 'flax>=0.12.6,<0.13' 'jax>=0.10.0,<0.11' 'jaxlib>=0.10.0,<0.11'"


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


class Internal:
  """One Flax or JAX internal: `name` (dotted: an attribute of an attribute) of `module`.

  Calling it returns the object, imported and looked up on the first call and kept;
  an import or lookup that fails raises `UnsupportedFlaxFeatureError` (see
  `unsupported`), at that call and at every later one.

  Example:
    >>> from flaxlens._compat import Internal
    >>> Internal("flax.core.scope", "LazyRng")().__name__
    'LazyRng'
  """

  __slots__ = ("module", "name", "_value")

  def __init__(self, module: str, name: str):
    self.module = module
    self.name = name
    self._value: Any = _MISSING
    DECLARED.append(self)

  def __repr__(self) -> str:
    return f"Internal({self.module!r}, {self.name!r})"

  @property
  def full_name(self) -> str:
    return f"{self.module}.{self.name}"

  def __call__(self) -> Any:
    value = self._value
    if value is _MISSING:
      try:
        value = importlib.import_module(self.module)
        for part in self.name.split("."):
          value = getattr(value, part)
      except (ImportError, AttributeError) as e:
        raise unsupported(self.full_name) from e
      self._value = value
    return value

  def site(self) -> tuple[Any, str]:
    """`(owner, name)`: the module or class that holds this internal, and its last name.

    What `patching.patched` takes to replace it in place; checked to exist first.
    """
    self()
    owner = importlib.import_module(self.module)
    *path, last = self.name.split(".")
    for part in path:
      owner = getattr(owner, part)
    return owner, last

  def resolved(self) -> bool:
    """Whether this internal has been looked up (successfully) already."""
    return self._value is not _MISSING


_MISSING = object()
DECLARED: list[Internal] = []  # Every `Internal` made, in the order the modules made them.
