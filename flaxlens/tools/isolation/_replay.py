"""An isolated call and its replay: `IsolatedSubmodel`.

An `IsolatedSubmodel` holds one execution of one call cut out of a model (see
`_isolate`): the call as a standalone layer, what it received and what it produced.
`replay()` runs it again, as it ran when recorded (eagerly or compiled), and compares
every output and state leaf bit for bit (an `EquivalenceReport`, `tools/base/_compare.py`).
No Flax internals here.
"""

from __future__ import annotations

from typing import Any

import jax

from flaxlens.core._jit import variable_jit
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._variables import bind_variables, unbind_variables
from flaxlens.tools.base._compare import EquivalenceReport, compare_states, compare_trees


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
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> isolated = fl.isolate(tree, x, "layers_0")
    >>> output, _ = isolated.submodel.stateless_call(
    ...   isolated.initial_var_values, isolated.saved_arg, **isolated.saved_side_inputs)
    >>> bool((output == isolated.saved_output).all()), isolated.replay().bitwise
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

  def replay(self, jit: bool | None = None) -> EquivalenceReport:
    """Re-runs the submodel on the saved inputs and compares with the saved results, bit for bit.

    Args:
      jit: None (the default) runs the call as it ran when recorded: under `jax.jit` if
        it was recorded in compiled code (`recorded_compiled`), else eagerly, which
        reproduces the saved results bit for bit. True or False forces a mode; the other
        mode can differ in the last bits, because XLA rounds a compiled program (fused,
        reassociated operations) differently from the same operations run one by one.
        Python-valued arguments stay static under jit.

    Returns:
      An `EquivalenceReport` of the replay (side a) against the saved results (side b):
      truthy only when every output and state leaf matches bit for bit; its `note`
      says why a replay in the other mode may differ.

    Example:
      >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
      >>> model = nn.Sequential([nn.Dense(4), nn.gelu, nn.Dense(2)])
      >>> x = jnp.ones((1, 3))
      >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
      >>> isolated = fl.isolate(tree, x, "layers_2")
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
    return EquivalenceReport(
      a=f"replay ({'compiled' if compiled else 'eager'})",
      b="saved results",
      outputs=compare_trees(output, self.saved_output),
      state=compare_states(_by_label(state), _by_label(self.final_var_values)),
      note="" if compiled == self.recorded_compiled else _OTHER_MODE_NOTE[self.recorded_compiled],
    )


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
