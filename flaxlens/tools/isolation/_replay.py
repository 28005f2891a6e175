"""An isolated call and its replay: `IsolatedSubmodel`, and `ReplayReport`'s bit-for-bit diff.

An `IsolatedSubmodel` holds one execution of one call cut out of a model (see
`_isolate`): the call as a standalone layer, what it received and what it produced.
`replay()` runs it again, as it ran when recorded (eagerly or compiled), and compares
every output and state leaf bit for bit (`ReplayReport`). No Flax internals here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from flaxlens.core._jit import variable_jit
from flaxlens.core._recorder import is_key
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._variables import Uninitialized, bind_variables, unbind_variables


class IsolatedSubmodel(Struct):
  """One execution of one call, cut out of a model with everything needed to replay it.

  Attributes:
    submodel: the call as a layer of its own; parameters are frozen in, state variables
      are slots.
    saved_arg: the `ArgsAndKwargs` the call received (Python values stay Python values).
    saved_side_inputs: the side inputs to pass when replaying.
    saved_output: what the call returned.
    initial_var_values: the state variables' values before the call.
    final_var_values: their values after the call, in the order `stateless_call`
      returns them.
    call_number: which execution of the selected call this is (0 for the first; inside
      `nn.scan` the iteration, inside `nn.vmap` the batch member).
    recorded_compiled: whether the call ran as compiled code when it was recorded: inside
      `nn.jit`/`nnx.jit`, or in the body of `nn.scan`/`nnx.scan` (a `lax.scan`, compiled
      even when the model runs eagerly) or of another compiling transform. `replay()`
      runs it the same way by default.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(4), nn.relu]), jnp.ones((1, 3))
    >>> isolated = fl.isolate(model, model.init(jax.random.key(0), x), x, at="layers_0")
    >>> output, _ = isolated.submodel.stateless_call(
    ...   isolated.initial_var_values, isolated.saved_arg, **isolated.saved_side_inputs)
    >>> bool((output == isolated.saved_output).all()), isolated.replay().exact
    (True, True)
  """

  submodel: Any
  saved_arg: Any
  saved_side_inputs: dict[str, Any]
  saved_output: Any
  initial_var_values: tuple[Any, ...]
  final_var_values: tuple[Any, ...]
  call_number: int = static_field(default=0)
  recorded_compiled: bool = static_field(default=False)

  def replay(self, jit: bool | None = None) -> ReplayReport:
    """Re-runs the submodel on the saved inputs and compares with the saved results, bit for bit.

    Args:
      jit: None (the default) runs the call as it ran when recorded: under `jax.jit` if
        it was recorded in compiled code (`recorded_compiled`), else eagerly, which
        reproduces the saved results bit for bit. True or False forces a mode; the other
        mode can differ in the last bits, because XLA rounds a compiled program (fused,
        reassociated operations) differently from the same operations run one by one.
        Python-valued arguments stay static under jit.

    Returns:
      A `ReplayReport`; it is truthy only when every output and state leaf matches bit
      for bit.

    Example:
      >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
      >>> model = nn.Sequential([nn.Dense(4), nn.gelu, nn.Dense(2)])
      >>> x = jnp.ones((1, 3))
      >>> isolated = fl.isolate(model, model.init(jax.random.key(0), x), x, at="layers_2")
      >>> isolated.recorded_compiled, bool(isolated.replay())
      (False, True)
    """
    compiled = self.recorded_compiled if jit is None else jit
    # A copy, so stateful objects among the arguments (an nnx.Rngs) start as saved.
    saved_arg = jax.tree_util.tree_map(lambda x: x, self.saved_arg)
    if compiled:
      bound = bind_variables(self.submodel, self.initial_var_values)
      run = variable_jit(lambda layer, arg, side: layer(arg, **side))
      output = run(bound, saved_arg, self.saved_side_inputs)
      _, state = unbind_variables(bound, freeze=True)
      state = tuple(v for v in state if v.label in {f.label for f in self.final_var_values})
    else:
      output, state = self.submodel.stateless_call(
        self.initial_var_values, saved_arg, **self.saved_side_inputs
      )
    expected = {"output": self.saved_output, "state": _by_label(self.final_var_values)}
    report = ReplayReport.compare({"output": output, "state": _by_label(state)}, expected)
    if compiled == self.recorded_compiled:
      return report
    return dataclasses.replace(report, note=_OTHER_MODE_NOTE[self.recorded_compiled])


_OTHER_MODE_NOTE = {
  True: (
    "recorded in compiled code (inside jit, or a scan body) but replayed eagerly, one"
    " operation at a time, which XLA can round differently in the last bits; replay()"
    " with the default jit=None reproduces the recording."
  ),
  False: (
    "recorded eagerly, one operation at a time, but replayed under jit, whose compiled"
    " program XLA can round differently in the last bits; replay() with the default"
    " jit=None reproduces the recording."
  ),
}


def _by_label(values: tuple[Any, ...]) -> dict[str, Any]:
  return {v.label: v.value for v in values}


@dataclasses.dataclass(frozen=True)
class ReplayReport:
  """Per-leaf comparison of a replay with the saved results: bits, and the distance.

  Attributes:
    identical: `{leaf path: whether shape, dtype and every bit match}`; `+0.0` and
      `-0.0`, or two NaNs with different payloads, are different bits.
    max_abs_diff: `{leaf path: max |replayed - saved|}` (0.0 where the values are equal,
      even if their bits are not; inf when shapes, dtypes or structure differ, or a NaN
      faces a number).
    note: why a replay in a mode other than the recorded one may differ ("" otherwise).

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> report = fl.ReplayReport.compare({"y": jnp.array([-0.0])}, {"y": jnp.array([0.0])})
    >>> bool(report), report.max_abs_diff["['y']"]
    (False, 0.0)
  """

  identical: dict[str, bool]
  max_abs_diff: dict[str, float]
  note: str = ""

  @property
  def exact(self) -> bool:
    """Whether every leaf matched bit for bit."""
    return all(self.identical.values())

  def __bool__(self) -> bool:
    return self.exact

  def __str__(self) -> str:
    width = max((len(k) for k in self.identical), default=0)
    lines = [f"{path:<{width}}  {self.verdict(path)}" for path in self.identical]
    lines.append("exact replay" if self.exact else "replay differs")
    if self.note and not self.exact:
      lines.append(f"note: {self.note}")
    return "\n".join(lines)

  def verdict(self, path: str) -> str:
    """`"match"`, or how the leaf at `path` differs."""
    if self.identical[path]:
      return "match"
    diff = self.max_abs_diff[path]
    if diff == 0.0:
      return "MISMATCH in bits only (signed zeros or NaN payloads)"
    return f"MISMATCH max diff {diff:.3g}"

  @classmethod
  def compare(cls, actual: Any, expected: Any) -> ReplayReport:
    """Compares two pytrees leaf by leaf (PRNG keys by their key data)."""
    got = dict(jax.tree_util.tree_flatten_with_path(actual, is_leaf=_is_uninitialized)[0])
    want = dict(jax.tree_util.tree_flatten_with_path(expected, is_leaf=_is_uninitialized)[0])
    identical, diffs = {}, {}
    for path in sorted(set(got) | set(want), key=jax.tree_util.keystr):
      name = jax.tree_util.keystr(path)
      identical[name], diffs[name] = _compare_leaf(
        got.get(path, _MISSING), want.get(path, _MISSING)
      )
    return cls(identical, diffs)


_MISSING = object()
_DIFFERENT = (False, float("inf"))


def _is_uninitialized(x: Any) -> bool:
  return isinstance(x, Uninitialized)


def _compare_leaf(a: Any, b: Any) -> tuple[bool, float]:
  """`(same bits, max |a - b|)` for two leaves."""
  if a is _MISSING or b is _MISSING:
    return _DIFFERENT
  if _is_uninitialized(a) or _is_uninitialized(b):
    return (True, 0.0) if _is_uninitialized(a) and _is_uninitialized(b) else _DIFFERENT
  if is_key(a) or is_key(b):
    if not (is_key(a) and is_key(b)) or jax.random.key_impl(a) != jax.random.key_impl(b):
      return _DIFFERENT
    a, b = jax.random.key_data(a), jax.random.key_data(b)
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    return _DIFFERENT
  if a.dtype.hasobject:
    same = bool(np.all(a == b))
    return (same, 0.0) if same else _DIFFERENT
  if np.array_equal(raw_bits(a), raw_bits(b)):
    return True, 0.0
  if a.dtype.kind in "iu":
    return False, float(np.max(np.abs(a.astype(np.int64) - b.astype(np.int64))))
  if a.dtype.kind not in "fc":
    return _DIFFERENT
  wide = np.complex128 if a.dtype.kind == "c" else np.float64
  a, b = a.astype(wide), b.astype(wide)
  nan_a, nan_b = np.isnan(a), np.isnan(b)
  if np.any(nan_a != nan_b):
    return _DIFFERENT
  both = nan_a & nan_b
  return False, float(np.max(np.abs(np.where(both, 0, a) - np.where(both, 0, b)), initial=0.0))


def raw_bits(x: np.ndarray) -> np.ndarray:
  """The raw bytes of an array, in C order (signed zeros and NaN payloads included)."""
  return np.ascontiguousarray(x).reshape(-1).view(np.uint8)
