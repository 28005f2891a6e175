"""The one comparison of two pytrees, leaf by leaf: `EquivalenceReport` and its rows.

`isolated.replay()` (the replay against the recording) and `fl.check_equivalence` (two
models on the same inputs) both report through it, and `fl.fold` checks its folded calls
with it. Leaves are compared by their raw bits first (so `-0.0` and `0.0`, or two NaNs
with different payloads, differ), then by their largest absolute and relative distance;
PRNG keys by their implementation and key data; a leaf present on one side only, or two
pytrees of different structure, is a row that differs. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._recorder import is_key
from flaxlens.core._variables import Uninitialized


class LeafComparison(NamedTuple):
  """One output leaf or variable of both sides, compared.

  Attributes:
    name: `"output"` plus the leaf's key path (`"output['logits']"`), or the variable's
      label (`"params:Dense_0/kernel"`, `"BatchStat:norm/mean"`) plus the key path of a
      leaf inside its value.
    bitwise: whether shape, dtype and every bit agree (`-0.0` and `0.0` differ).
    max_abs: the largest `|a - b|` (0.0 where the values are equal, even if their bits
      are not; inf where the leaves cannot be compared: other shapes or dtypes, present
      on one side only, NaN facing a number).
    max_rel: the largest `|a - b| / max(|a|, |b|)` (0 where both are 0; inf as above).
    note: why the leaves cannot be compared, or that they differ in bits only ("" when
      they are bitwise equal or simply differ in value).
  """

  name: str
  bitwise: bool
  max_abs: float
  max_rel: float
  note: str = ""


@dataclasses.dataclass(frozen=True)
class EquivalenceReport:
  """How two sides' outputs and states compare, leaf by leaf.

  `fl.check_equivalence` returns one for two models run on the same inputs, and
  `isolated.replay()` one for a replay against the saved results. The report is truthy
  only when every leaf is bitwise equal, so `assert report` checks exactness;
  `report.close(atol=..., rtol=...)` checks a tolerance. `print(report)` shows a table,
  one row per leaf.

  Attributes:
    a: what the first side was (`"tree MLP.__call__"`, `"Linen MLP with variables"`,
      `"replay (eager)"`).
    b: what the second side was (`"saved results"` for a replay).
    outputs: one `LeafComparison` per output leaf (and one named `"output structure"`
      if the outputs' pytree structures differ).
    state: one `LeafComparison` per variable after the call: Linen, the parameters and
      the mutable collections (a replay: the isolated call's state variables); NNX,
      every variable.
    note: why the two sides may differ in their last bits (a replay in another mode
      than the recorded one), "" otherwise.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> report = fl.check_equivalence((model, variables), fl.unflaxify(model, variables, x), x)
    >>> bool(report), report.max_abs
    (True, 0.0)
    >>> signed = fl.EquivalenceReport.compare(jnp.array([-0.0]), jnp.array([0.0]))
    >>> bool(signed), signed.max_abs, signed.rows[0].note
    (False, 0.0, 'bits only: signed zeros or NaN payloads')
  """

  a: str
  b: str
  outputs: tuple[LeafComparison, ...]
  state: tuple[LeafComparison, ...]
  note: str = ""

  @classmethod
  def compare(cls, a: Any, b: Any) -> EquivalenceReport:
    """Compares two pytrees leaf by leaf, as outputs (`"output"` plus each key path)."""
    return cls("a", "b", compare_trees(a, b), ())

  @property
  def rows(self) -> tuple[LeafComparison, ...]:
    """Every comparison, outputs first."""
    return self.outputs + self.state

  @property
  def bitwise(self) -> bool:
    """Whether every output and state leaf is bitwise equal."""
    return all(r.bitwise for r in self.rows)

  @property
  def max_abs(self) -> float:
    """The largest absolute difference over all leaves."""
    return max((r.max_abs for r in self.rows), default=0.0)

  @property
  def max_rel(self) -> float:
    """The largest relative difference over all leaves."""
    return max((r.max_rel for r in self.rows), default=0.0)

  def close(self, atol: float = 0.0, rtol: float = 0.0) -> bool:
    """Whether every leaf is within `atol` absolutely or within `rtol` relatively.

    A leaf passes when `max_abs <= atol` or `max_rel <= rtol`; leaves that cannot be
    compared (other shapes, missing on one side) never pass.
    """
    return all(r.max_abs <= atol or r.max_rel <= rtol for r in self.rows)

  def __bool__(self) -> bool:
    return self.bitwise

  def __str__(self) -> str:
    head = ("leaf", "bitwise", "max abs", "max rel", "")
    body = [
      (r.name, "yes" if r.bitwise else "NO", _number(r.max_abs), _number(r.max_rel), r.note)
      for r in self.rows
    ]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(4)]
    lines = [f"a: {self.a}", f"b: {self.b}"]
    for row in [head, *body]:
      cells = [f"{row[0]:<{widths[0]}}"]
      cells += [f"{c:>{w}}" for c, w in zip(row[1:4], widths[1:], strict=True)]
      lines.append("  ".join(cells + ([row[4]] if row[4] else [])).rstrip())
    lines.append(self.verdict())
    if self.note and not self.bitwise:
      lines.append(f"note: {self.note}")
    return "\n".join(lines)

  def verdict(self) -> str:
    """One line: every leaf bitwise equal, or how many differ and by how much."""
    if self.bitwise:
      return "equivalent: every leaf is bitwise equal"
    differ = sum(not r.bitwise for r in self.rows)
    return (
      f"NOT bitwise equal: {differ} of {len(self.rows)} leaves differ"
      f" (max abs {_number(self.max_abs)}, max rel {_number(self.max_rel)})"
    )


_MISSING = object()  # a variable only the other side has


def compare_states(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[LeafComparison, ...]:
  """Rows for two `{label: value}` states, in label order; a label on one side only differs."""
  return tuple(
    row
    for label in sorted(set(a) | set(b))
    for row in compare_trees(a.get(label, _MISSING), b.get(label, _MISSING), prefix=label)
  )


def compare_trees(a: Any, b: Any, prefix: str = "output") -> tuple[LeafComparison, ...]:
  """Rows for two pytrees, one per leaf named `prefix` plus its key path."""
  if a is _MISSING or b is _MISSING:
    note = "only in b" if a is _MISSING else "only in a"
    return (LeafComparison(prefix, False, math.inf, math.inf, note),)
  flat_a, def_a = jax.tree_util.tree_flatten_with_path(a, is_leaf=_is_uninitialized)
  flat_b, def_b = jax.tree_util.tree_flatten_with_path(b, is_leaf=_is_uninitialized)
  rows = []
  if def_a.num_leaves == def_b.num_leaves and def_a != def_b:
    rows.append(
      LeafComparison(f"{prefix} structure", False, math.inf, math.inf, "other pytree types")
    )
  leaves_a, leaves_b = dict(flat_a), dict(flat_b)
  for path in sorted(leaves_a.keys() | leaves_b.keys(), key=jax.tree_util.keystr):
    name = prefix + jax.tree_util.keystr(path)
    if path not in leaves_a or path not in leaves_b:
      note = "only in b" if path not in leaves_a else "only in a"
      rows.append(LeafComparison(name, False, math.inf, math.inf, note))
    else:
      rows.append(LeafComparison(name, *compare_leaf(leaves_a[path], leaves_b[path])))
  return tuple(rows)


def compare_leaf(a: Any, b: Any) -> tuple[bool, float, float, str]:
  """`(bitwise, max abs, max rel, note)` for two leaves.

  Example:
    >>> import numpy as np
    >>> from flaxlens.tools.base._compare import compare_leaf
    >>> compare_leaf(np.array([1.0, 4.0]), np.array([1.0, 5.0]))
    (False, 1.0, 0.2, '')
    >>> compare_leaf(np.array([3], np.uint8), np.array([5], np.uint8))
    (False, 2.0, 0.4, '')
  """
  if _is_uninitialized(a) or _is_uninitialized(b):
    if _is_uninitialized(a) and _is_uninitialized(b):
      return True, 0.0, 0.0, ""
    return False, math.inf, math.inf, "uninitialized against a value"
  if is_key(a) or is_key(b):
    if not (is_key(a) and is_key(b)):
      return False, math.inf, math.inf, "a PRNG key against another kind of value"
    if jax.random.key_impl(a) != jax.random.key_impl(b):
      return False, math.inf, math.inf, "PRNG keys of different implementations"
    a, b = jax.random.key_data(a), jax.random.key_data(b)
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    return False, math.inf, math.inf, f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
  if a.dtype.hasobject:
    same = bool(np.all(a == b))
    return (True, 0.0, 0.0, "") if same else (False, math.inf, math.inf, "other values")
  if np.array_equal(_raw_bits(a), _raw_bits(b)):
    return True, 0.0, 0.0, ""
  if a.dtype == np.bool_ or jnp.issubdtype(a.dtype, jnp.integer):
    # |a - b| exactly, even for 64-bit integers: the difference of the larger and the
    # smaller, taken modulo 2**64, is the true difference.
    if a.dtype == np.bool_:
      a, b = a.astype(np.uint8), b.astype(np.uint8)
    high, low = np.maximum(a, b), np.minimum(a, b)
    diff = (high.astype(np.uint64) - low.astype(np.uint64)).astype(np.float64)
    scale = np.maximum(np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64)))
    return False, *_distances(diff, scale), ""
  if not jnp.issubdtype(a.dtype, jnp.inexact):
    return False, math.inf, math.inf, f"{a.dtype} values that are not numbers differ"
  wide = np.complex128 if jnp.issubdtype(a.dtype, jnp.complexfloating) else np.float64
  a, b = a.astype(wide), b.astype(wide)
  nan_a, nan_b = np.isnan(a), np.isnan(b)
  if np.any(nan_a != nan_b):
    return False, math.inf, math.inf, "NaN against a number"
  equal = (a == b) | (nan_a & nan_b)  # infinities of one sign are equal: distance 0
  diff = np.abs(np.where(equal, 0, a) - np.where(equal, 0, b))
  scale = np.maximum(np.abs(np.where(nan_a, 0, a)), np.abs(np.where(nan_b, 0, b)))
  max_abs, max_rel = _distances(diff, scale)
  note = "bits only: signed zeros or NaN payloads" if max_abs == 0.0 else ""
  return False, max_abs, max_rel, note


def _distances(diff: np.ndarray, scale: np.ndarray) -> tuple[float, float]:
  """The largest absolute and relative difference; relative inf where it is undefined."""
  with np.errstate(invalid="ignore", divide="ignore"):
    rel = np.where(diff == 0, 0.0, diff / scale)
  rel = np.where(np.isnan(rel), np.inf, rel)
  return float(np.max(diff, initial=0.0)), float(np.max(rel, initial=0.0))


def _raw_bits(x: np.ndarray) -> np.ndarray:
  """The raw bytes of an array, in C order (signed zeros and NaN payloads included)."""
  return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _is_uninitialized(x: Any) -> bool:
  return isinstance(x, Uninitialized)


def _number(x: float) -> str:
  return "0" if x == 0 else f"{x:.3g}"
