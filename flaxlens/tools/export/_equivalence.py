"""`check_equivalence`: run two models on the same inputs and compare every output and state leaf.

Either side is a converted tree (any call node), a plain Linen model as the pair
`(module, variables)` (an exported tree's variables included), or an NNX module (an
exported tree included). Each side runs once without being modified (a tree through
`stateless_call`, a plain model on a copy, through its `FrameworkAdapter`), and the
report (`EquivalenceReport`) holds, per output leaf and per variable after the call,
whether the bits agree, the largest absolute and the largest relative difference. No
Flax internals here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import numpy as np

from flaxlens.core._adapter import adapter_for_model
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._node import CallNode
from flaxlens.core._recorder import is_key
from flaxlens.core._variables import Parameter, Uninitialized, variables_in
from flaxlens.errors import ArgumentError
from flaxlens.tools.analysis._calling import model_arguments, takes_model_arguments
from flaxlens.tools.isolation._replay import raw_bits


class LeafComparison(NamedTuple):
  """One output leaf or variable of both sides, compared.

  Attributes:
    name: `"output"` plus the leaf's key path (`"output['logits']"`), or the variable's
      label (`"params:Dense_0/kernel"`, `"BatchStat:norm/mean"`).
    bitwise: whether shape, dtype and every bit agree (`-0.0` and `0.0` differ).
    max_abs: the largest `|a - b|` (0.0 where bitwise; inf where the leaves cannot be
      compared: other shapes or dtypes, present on one side only, NaN facing a number).
    max_rel: the largest `|a - b| / max(|a|, |b|)` (0 where both are 0; inf as above).
    note: why the leaves cannot be compared ("" otherwise).
  """

  name: str
  bitwise: bool
  max_abs: float
  max_rel: float
  note: str = ""


@dataclasses.dataclass(frozen=True)
class EquivalenceReport:
  """How two models' outputs and states after one call compare, leaf by leaf.

  The report is truthy only when every leaf is bitwise equal, so `assert report` checks
  exactness; `report.close(atol=..., rtol=...)` checks a tolerance. `print(report)`
  shows a table, one row per leaf.

  Attributes:
    a: what the first side was (`"tree MLP.__call__"`, `"Linen MLP with variables"`).
    b: what the second side was.
    outputs: one `LeafComparison` per output leaf (and one named `"output structure"`
      if the outputs' pytree structures differ).
    state: one `LeafComparison` per variable after the call: Linen, the parameters and
      the mutable collections; NNX, every variable.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> report = fl.check_equivalence((model, variables), fl.unflaxify(model, variables, x), x)
    >>> bool(report), report.max_abs
    (True, 0.0)
  """

  a: str
  b: str
  outputs: tuple[LeafComparison, ...]
  state: tuple[LeafComparison, ...]

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
    if self.bitwise:
      verdict = "equivalent: every leaf is bitwise equal"
    else:
      differ = sum(not r.bitwise for r in self.rows)
      verdict = (
        f"NOT bitwise equal: {differ} of {len(self.rows)} leaves differ"
        f" (max abs {_number(self.max_abs)}, max rel {_number(self.max_rel)})"
      )
    lines.append(verdict)
    return "\n".join(lines)


@takes_model_arguments(
  "fl.check_equivalence(model, tree, fl.ArgsAndKwargs.capture(x, train=False))"
)
def check_equivalence(
  a: Any,
  b: Any,
  args: Any,
  /,
  *,
  method: Any = None,
  random_streams: Any = None,
  mutable: Any = False,
) -> EquivalenceReport:
  """Calls two models on the same inputs and compares their outputs and states.

  Each of `a` and `b` is a converted tree (any node), a Linen model as the pair
  `(module, variables)` (an exported tree's `(tree.module, tree.export())` included),
  or an NNX module (an exported tree included). Both run once on `args`,
  and nothing is modified: a tree runs through `stateless_call`, an NNX module as a
  copy, a Linen model through `module.apply`, and each gets its own copy of stateful
  arguments (an `nnx.Rngs`).

  Args:
    a: the first model.
    b: the second model.
    args: the model's arguments, as `fl.run` takes them: one value, a tuple of
      positional arguments, or `fl.ArgsAndKwargs` (keyword arguments too).
    method: the method plain models call (Linen: as `module.apply`'s `method`; NNX: a
      name or a function taking the module first; default `__call__`). A tree calls the
      method it was converted from.
    random_streams: Linen rng keys, as a tree call takes them (and `module.apply` as
      `rngs`). NNX models keep theirs in the model (an `rngs` argument of the call goes
      in `args`).
    mutable: the collections a Linen `module.apply` may update (as `module.apply`
      takes them); a Linen tree updates the collections it was converted with. Give the
      same ones, so that both sides report the same state.

  Returns:
    An `EquivalenceReport`; truthy when every leaf is bitwise equal.

  Raises:
    ArgumentError: if a side is none of the above (a Linen module without variables).

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> from flax import nnx
    >>> model, x = nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, x)
    >>> tree.scope_data.parameters["bias"].value += 0.5
    >>> report = fl.check_equivalence(model, tree, x)
    >>> bool(report), report.max_abs
    (False, 0.5)
    >>> bool(fl.check_equivalence(tree.export(), tree, x))
    True
  """
  argument = model_arguments(args)
  out_a, state_a = _run(a, "a", _fresh(argument), method, random_streams, mutable)
  out_b, state_b = _run(b, "b", _fresh(argument), method, random_streams, mutable)
  outputs = _compare_trees(out_a, out_b)
  state = tuple(
    row
    for label in sorted(set(state_a) | set(state_b))
    for row in _compare_trees(
      state_a.get(label, _MISSING), state_b.get(label, _MISSING), prefix=label
    )
  )
  return EquivalenceReport(_describe(a), _describe(b), outputs, state)


_MISSING = object()


def _fresh(argument: ArgsAndKwargs) -> ArgsAndKwargs:
  """The call's arguments, stateful pytree nodes in them (an `nnx.Rngs`) rebuilt.

  Each side gets its own, so neither sees what the other's call consumed, and the
  caller's arguments are left as they were.
  """
  return jax.tree_util.tree_map(lambda x: x, argument)


def _describe(model: Any) -> str:
  if isinstance(model, CallNode):
    return f"tree {model.where()}"
  if isinstance(model, tuple) and model:
    return f"Linen {type(model[0]).__name__} with variables"
  return f"NNX {type(model).__name__}"


def _run(
  model: Any, side: str, argument: ArgsAndKwargs, method: Any, rngs: Any, mutable: Any
) -> tuple[Any, dict[str, Any]]:
  if isinstance(model, CallNode):
    side_inputs = {} if rngs is None else {"random_streams": rngs}
    output, new_state = model.stateless_call((), argument, **side_inputs)
    state = {v.label: v.value for v in variables_in(model) if isinstance(v, Parameter)}
    state.update((v.label, v.value) for v in new_state)
    return output, {k: v for k, v in state.items() if not isinstance(v, Uninitialized)}
  adapter = adapter_for_model(model)
  if adapter is None:
    raise ArgumentError(
      f"check_equivalence: {side} must be a converted tree, a Linen (module, variables)"
      f" pair or an NNX module, got {type(model).__name__}. Pass one of those."
    )
  return adapter.run_native(model, argument, method, rngs, mutable)


def _compare_trees(a: Any, b: Any, prefix: str = "output") -> tuple[LeafComparison, ...]:
  if a is _MISSING or b is _MISSING:
    note = "only in b" if a is _MISSING else "only in a"
    return (LeafComparison(prefix, False, math.inf, math.inf, note),)
  flat_a, def_a = jax.tree_util.tree_flatten_with_path(a)
  flat_b, def_b = jax.tree_util.tree_flatten_with_path(b)
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
      rows.append(LeafComparison(name, *_compare_leaf(leaves_a[path], leaves_b[path])))
  return tuple(rows)


def _compare_leaf(a: Any, b: Any) -> tuple[bool, float, float, str]:
  """`(bitwise, max abs, max rel, note)` for two leaves."""
  if is_key(a) or is_key(b):
    if not (is_key(a) and is_key(b)) or jax.random.key_impl(a) != jax.random.key_impl(b):
      return False, math.inf, math.inf, "a PRNG key against another kind of value"
    a, b = jax.random.key_data(a), jax.random.key_data(b)
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    return False, math.inf, math.inf, f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
  if a.dtype.hasobject:
    same = bool(np.all(a == b))
    return same, 0.0 if same else math.inf, 0.0 if same else math.inf, ""
  if np.array_equal(raw_bits(a), raw_bits(b)):
    return True, 0.0, 0.0, ""
  wide = np.complex128 if a.dtype.kind == "c" else np.float64
  a, b = a.astype(wide), b.astype(wide)
  nan_a, nan_b = np.isnan(a), np.isnan(b)
  if np.any(nan_a != nan_b):
    return False, math.inf, math.inf, "NaN against a number"
  a, b = np.where(nan_a, 0, a), np.where(nan_b, 0, b)
  diff = np.abs(a - b)
  scale = np.maximum(np.abs(a), np.abs(b))
  with np.errstate(invalid="ignore", divide="ignore"):
    rel = np.where(diff == 0, 0.0, diff / scale)  # inf - inf is NaN: not comparable.
  rel = np.where(np.isnan(rel), np.inf, rel)
  return False, float(np.max(diff, initial=0.0)), float(np.max(rel, initial=0.0)), ""


def _number(x: float) -> str:
  return "0" if x == 0 else f"{x:.3g}"
