"""`CallRecord`: what conversion saw of one call, before the converter makes it a node.

Conversion traces abstractly, so code that needs an array's value cannot run;
`converting` turns JAX's errors for that into one that names the call. No Flax
internals here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax

from flaxlens.core._names import CallKey, Path
from flaxlens.core._spec import CallSpec
from flaxlens.errors import FlaxlensError


class CallRecord:
  """What conversion saw of one call; the converter turns records into nodes."""

  __slots__ = ("module", "path", "method_name", "children", "extra", "spec")

  def __init__(self, module: Any, path: Path, method_name: Any):
    self.module = module
    self.path = path
    self.method_name = method_name
    self.children: list[tuple[CallKey, CallRecord]] = []
    self.extra: dict[str, Any] = {}
    self.spec: CallSpec | None = None

  def call_specs(self) -> tuple[CallSpec, ...]:
    """The specs of this call's submodule calls, for the node's `call_specs` field."""
    return tuple(child.spec for _, child in self.children if child.spec is not None)

  def walk(self) -> Iterator[CallRecord]:
    yield self
    for _, child in self.children:
      yield from child.walk()

  def where(self) -> str:
    """`"Block_0/Dense_0.__call__"`: the call's module path and method, for messages."""
    kind = self.module if isinstance(self.module, type) else type(self.module)
    name = self.method_name
    if not isinstance(name, str):
      name = getattr(name, "__name__", type(name).__name__)
    return f"{'/'.join(str(p) for p in self.path) or kind.__name__}.{name}"


# Errors JAX raises when code needs the value of an array that is only abstract.
_NEEDS_VALUES = (
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerIntegerConversionError,
  jax.errors.TracerArrayConversionError,
  jax.errors.NonConcreteBooleanIndexError,
)


@contextmanager
def converting(record: CallRecord) -> Iterator[None]:
  """Explains JAX's errors for code that needs array values while converting `record`.

  Conversion traces abstractly (arrays have shapes, not values), so a Python branch on
  an array's value cannot run; the error names the innermost call being converted.
  """
  try:
    yield
  except _NEEDS_VALUES as e:
    raise FlaxlensError(
      f"{record.where()}: this call uses the value of an array in Python (`if float(h.mean()) >"
      f" 0`, `int(n)`, ...), which conversion cannot provide: it traces abstractly, with"
      f" shapes and no values ({type(e).__name__}). Compute the branch with jnp.where or"
      " jax.lax.cond, or, if it depends on an argument, pass that argument as a Python"
      " value (static) rather than an array."
    ) from e
