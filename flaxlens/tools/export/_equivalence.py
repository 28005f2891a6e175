"""`check_equivalence`: run two models on the same inputs and compare every output and state leaf.

Either side is a converted tree (any call node), a plain Linen model as the pair
`(module, variables)` (an exported tree's variables included), or an NNX module (an
exported tree included). Each side runs once without being modified (a tree through
`stateless_call`, a plain model on a copy, through its `FrameworkAdapter`), and the
report (`EquivalenceReport`, `tools/base/_compare.py`) holds, per output leaf and per variable
after the call, whether the bits agree, the largest absolute and the largest relative
difference. No Flax internals here.
"""

from __future__ import annotations

from typing import Any

import jax

from flaxlens.core._adapter import adapter_for_model
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._node import CallNode
from flaxlens.core._runtime import resolve_random_streams
from flaxlens.core._variables import Parameter, Uninitialized, variables_in
from flaxlens.errors import ArgumentError, FlaxlensError, error_text, model_call_error
from flaxlens.tools.base._calling import model_arguments, takes_model_arguments
from flaxlens.tools.base._compare import EquivalenceReport, compare_states, compare_trees


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
      `rngs`); an `fl.RandomStream` gives both sides the key a tree call would draw
      next, and is not advanced. NNX models keep theirs in the model (an `rngs`
      argument of the call goes in `args`).
    mutable: the collections a Linen `module.apply` may update (as `module.apply`
      takes them); a Linen tree updates the collections it was converted with. Give the
      same ones, so that both sides report the same state.

  Returns:
    An `EquivalenceReport`; truthy when every leaf is bitwise equal.

  Raises:
    ArgumentError: if a side is none of the above (a Linen module without variables).
    ModelCallError: if a plain model fails in its own code (naming the side; also an
      instance of the original error's class), as a tree's failures are raised.

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
  # Both sides draw the keys a tree call would draw now; the caller's streams stay put.
  keys = resolve_random_streams(random_streams, "fl.check_equivalence", advance=False)
  out_a, state_a = _run(a, "a", _fresh(argument), method, keys, mutable)
  out_b, state_b = _run(b, "b", _fresh(argument), method, keys, mutable)
  outputs = compare_trees(out_a, out_b)
  return EquivalenceReport(_describe(a), _describe(b), outputs, compare_states(state_a, state_b))


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
  try:
    return adapter.run_native(model, argument, method, rngs, mutable)
  except FlaxlensError:
    raise
  except Exception as e:
    # Also an instance of the original's class, as a tree call's failures are.
    raise model_call_error(
      type(e),
      f"fl.check_equivalence: side {side} ({_describe(model)}) failed inside the model's own"
      f" code ({error_text(e)}; the original error is"
      f" this one's cause). {adapter.native_call_fix(e)}",
    ) from e
