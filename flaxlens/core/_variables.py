"""Variables: mutable parameter and state holders inside otherwise immutable trees.

A `Parameter` or `StateVariable` is a small mutable object with a `label` and a
`.value`; it is deliberately *not* a pytree, so a tree that holds one is "bound". To pass
such a tree through a JAX transformation, `unbind_variables` swaps every variable for a
slot that only remembers its label and returns the variables beside the tree;
`bind_variables` puts them (or fresh copies made from frozen values) back. A variable
reachable twice (shared weights) becomes two slots with one label, so sharing survives
the round trip. JAX's trace state is read through `flaxlens._compat.tracing`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from flaxlens._compat.tracing import current_trace
from flaxlens.core._struct import Struct, static_field
from flaxlens.errors import ArgumentError, VariableError

_label_counter = itertools.count()
_PARAMETER_COLOR, _STATE_VARIABLE_COLOR = "#cde8ff", "#ffe2c2"


def _holds_tracer(value: Any) -> bool:
  if isinstance(value, jax.core.Tracer):
    return True
  if isinstance(value, jax.Array | np.ndarray | int | float | bool | str | type(None)):
    return False
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(value))


def check_storable(variable: AbstractVariable, value: Any, where: str | None = None) -> None:
  """Refuses to store a JAX tracer in a variable that would outlive the tracer's trace.

  A variable may hold a traced value only while the transformation it was created in
  is running: `fl.variable_jit` and `stateless_call` create fresh variables inside the
  trace, so their writes are fine. Writing a tracer into a variable made outside (a
  tree called under `jax.jit`, a stateful replacement inside an `nn.scan` body) would
  leave a dead tracer in it that breaks every later call.

  Raises:
    VariableError: naming the variable, `where` it happened and what to use instead.
  """
  if not _holds_tracer(value) or variable._trace == current_trace():
    return
  at = f"{where}: " if where else ""
  raise VariableError(
    f"{at}storing a traced value in the {type(variable).__name__} {variable.label!r},"
    " which was created outside the JAX transformation (jax.jit, grad, vmap, a lifted"
    " nn.scan/nnx.scan body...) being traced; the tracer would outlive its trace and"
    " break every later call. Run the tree under fl.variable_jit instead of jax.jit, or"
    " transform tree.stateless_call(values, argument) (it returns the new state); inside"
    " scan or vmap bodies, keep per-iteration state in the model's own variables."
  )


class AbstractVariable:
  """Base class of the mutable holders `Parameter` and `StateVariable`.

  Assigning a JAX tracer to `.value` is refused (`VariableError`) unless the variable
  was created inside the transformation being traced; see `check_storable`.
  """

  __slots__ = ("_label", "_value", "_trace")

  def __init__(self, value: Any, label: str | None = None):
    if label is None:
      label = f"{type(self).__name__.lower()}_{next(_label_counter)}"
    if not isinstance(label, str):
      raise ArgumentError(f"A variable label must be a string, got {label!r}.")
    self._label = label
    self._trace = current_trace()
    self._value = value

  @property
  def label(self) -> str:
    """The name that identifies this variable; fixed when it is made."""
    return self._label

  @label.setter
  def label(self, label: str) -> None:
    raise VariableError(
      f"The label of {type(self).__name__} {self._label!r} cannot change: labels identify"
      " variables (compiled calls, unbinding and export rely on them). Make a variable with"
      f" the new label instead ({type(self).__name__}(variable.value, label={label!r})), or"
      " relabel a whole tree with fl.relabel_variables(tree, prefix)."
    )

  @property
  def value(self) -> Any:
    """The current value."""
    return self._value

  def __getstate__(self) -> dict[str, Any]:
    return {"label": self.label, "value": self._value}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self._label = state["label"]
    self._trace = current_trace()
    self._value = state["value"]

  @value.setter
  def value(self, value: Any) -> None:
    check_storable(self, value)
    self._value = value

  def freeze(self) -> AbstractVariableValue:
    """Returns an immutable snapshot (a pytree) of this variable's current value."""
    raise NotImplementedError

  def slot(self) -> AbstractVariableSlot:
    """Returns the slot that marks where this variable was unbound."""
    raise NotImplementedError

  def __repr__(self) -> str:
    value = self.value
    shown = f"<{value.dtype}{list(value.shape)}>" if hasattr(value, "shape") else repr(value)
    return f"{type(self).__name__}(label={self.label!r}, value={shown})"

  def treescope_color(self) -> str | None:
    """The background color treescope uses for this variable (None: no color)."""
    return None


class Parameter(AbstractVariable):
  """A learnable parameter: a mutable holder of a value, identified by its label.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> w = fl.Parameter(jnp.ones(3), label="dense/kernel")
    >>> w.value = w.value * 2
    >>> w.freeze()
    ParameterValue(value=Array([2., 2., 2.], dtype=float32), label='dense/kernel')
  """

  __slots__ = ()

  def freeze(self) -> ParameterValue:
    return ParameterValue(value=self.value, label=self.label)

  def treescope_color(self) -> str:
    return _PARAMETER_COLOR

  def slot(self) -> ParameterSlot:
    return ParameterSlot(label=self.label)


class StateVariable(AbstractVariable):
  """A piece of mutable model state (batch statistics, caches, counters).

  Example:
    >>> import flaxlens as fl
    >>> count = fl.StateVariable(0, label="counter")
    >>> count.value += 1
    >>> count.value
    1
  """

  __slots__ = ()

  def freeze(self) -> StateVariableValue:
    return StateVariableValue(value=self.value, label=self.label)

  def treescope_color(self) -> str:
    return _STATE_VARIABLE_COLOR

  def slot(self) -> StateVariableSlot:
    return StateVariableSlot(label=self.label)


class AbstractVariableValue(Struct):
  """Frozen snapshot of a variable; a pytree whose only child is `value`."""

  _flaxlens_flat_in_cpp = True  # flattened at every call of a jitted stateless_call

  value: Any
  label: str = static_field()

  def unfreeze_as_copy(self) -> AbstractVariable:
    """Makes a new mutable variable holding this value."""
    raise NotImplementedError


class ParameterValue(AbstractVariableValue):
  """Frozen value of a `Parameter`."""

  def unfreeze_as_copy(self) -> Parameter:
    return Parameter(self.value, label=self.label)

  def treescope_color(self) -> str:
    return _PARAMETER_COLOR


class StateVariableValue(AbstractVariableValue):
  """Frozen value of a `StateVariable`."""

  def unfreeze_as_copy(self) -> StateVariable:
    return StateVariable(self.value, label=self.label)

  def treescope_color(self) -> str:
    return _STATE_VARIABLE_COLOR


class AbstractVariableSlot(Struct):
  """Marks where a variable was unbound; has no pytree children."""

  label: str = static_field()


class ParameterSlot(AbstractVariableSlot):
  """Where a `Parameter` with this label goes back in."""


class StateVariableSlot(AbstractVariableSlot):
  """Where a `StateVariable` with this label goes back in."""


_SLOT_KIND = {ParameterSlot: Parameter, StateVariableSlot: StateVariable}


def _is_variable(x: Any) -> bool:
  return isinstance(x, AbstractVariable)


def _is_variable_or_slot(x: Any) -> bool:
  return isinstance(x, AbstractVariable | AbstractVariableSlot)


def variables_in(tree: Any) -> tuple[AbstractVariable, ...]:
  """Returns the distinct bound variables of `tree`, in traversal order.

  Raises:
    VariableError: if two different variable objects carry the same label.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> [v.label for v in fl.variables_in(tree)]
    ['params:bias', 'params:kernel']
  """
  found: dict[str, AbstractVariable] = {}
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=_is_variable):
    if isinstance(leaf, AbstractVariable):
      seen = found.setdefault(leaf.label, leaf)
      if seen is not leaf:
        raise VariableError(
          f"Two different variables share the label {leaf.label!r}. Labels identify"
          " variables, so each must be unique; give one of them another label (for a"
          " second converted model: other = fl.relabel_variables(other, 'teacher/'))."
        )
  return tuple(found.values())


def slots_in(tree: Any) -> tuple[AbstractVariableSlot, ...]:
  """Returns the slots of `tree` (one per label), in traversal order."""
  found: dict[str, AbstractVariableSlot] = {}
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=_is_variable_or_slot):
    if isinstance(leaf, AbstractVariableSlot):
      found.setdefault(leaf.label, leaf)
  return tuple(found.values())


def unbind_variables(
  tree: Any,
  predicate: Callable[[AbstractVariable], bool] | None = None,
  freeze: bool = False,
) -> tuple[Any, tuple[Any, ...]]:
  """Replaces variables in `tree` by slots and returns them beside the new tree.

  Args:
    tree: any pytree that may hold `Parameter`s and `StateVariable`s.
    predicate: if given, only variables for which it returns True are unbound.
    freeze: return frozen values (`ParameterValue` / `StateVariableValue`) instead of
      the variable objects.

  Returns:
    `(tree_with_slots, variables)`, one entry in `variables` per distinct variable.

  Example:
    >>> import flaxlens as fl
    >>> w = fl.Parameter(1.0, label="w")
    >>> tree, (var,) = fl.unbind_variables({"a": w, "b": w})
    >>> tree["a"], var is w
    (ParameterSlot(label='w'), True)
  """
  if predicate is not None and not callable(predicate):
    raise ArgumentError(f"unbind_variables: predicate must be callable, got {predicate!r}.")
  chosen = [v for v in variables_in(tree) if predicate is None or predicate(v)]
  chosen_ids = {id(v) for v in chosen}

  def swap(leaf: Any) -> Any:
    return leaf.slot() if id(leaf) in chosen_ids else leaf

  new_tree = jax.tree_util.tree_map(swap, tree, is_leaf=_is_variable)
  if freeze:
    return new_tree, tuple(v.freeze() for v in chosen)
  return new_tree, tuple(chosen)


def bind_variables(
  tree: Any,
  variables: Iterable[AbstractVariable | AbstractVariableValue],
  allow_unused: bool = False,
) -> Any:
  """Fills the slots of `tree` with variables, matched by label.

  Frozen values are turned into fresh mutable variables first (one per label, so two
  slots with the same label share one variable); variable objects are inserted as is.

  Args:
    tree: a pytree holding slots.
    variables: variables or frozen values to insert.
    allow_unused: accept variables whose label matches no slot.

  Raises:
    VariableError: on duplicate labels, a label with no slot (unless `allow_unused`),
      or a parameter given for a state slot (or the reverse).

  Example:
    >>> import flaxlens as fl
    >>> tree = {"w": fl.ParameterSlot(label="w")}
    >>> fl.bind_variables(tree, [fl.ParameterValue(value=3.0, label="w")])["w"].value
    3.0
  """
  by_label: dict[str, AbstractVariable] = {}
  for var in variables:
    if isinstance(var, AbstractVariableValue):
      var = var.unfreeze_as_copy()
    if not isinstance(var, AbstractVariable):
      raise ArgumentError(
        f"bind_variables expects Parameters, StateVariables or their frozen values,"
        f" got {type(var).__name__}."
      )
    if var.label in by_label:
      raise VariableError(f"bind_variables got two variables labelled {var.label!r}.")
    by_label[var.label] = var

  used: set[str] = set()

  def fill(leaf: Any) -> Any:
    if not isinstance(leaf, AbstractVariableSlot) or leaf.label not in by_label:
      return leaf
    var = by_label[leaf.label]
    expected = _SLOT_KIND[type(leaf)]
    if not isinstance(var, expected):
      raise VariableError(
        f"Slot {leaf.label!r} holds a {expected.__name__}, but a"
        f" {type(var).__name__} was given for it."
      )
    used.add(leaf.label)
    return var

  new_tree = jax.tree_util.tree_map(fill, tree, is_leaf=_is_variable_or_slot)
  unused = sorted(set(by_label) - used)
  if unused and not allow_unused:
    raise VariableError(
      f"No slot in the tree for the variable label(s) {unused}. Check the labels,"
      " or pass allow_unused=True to ignore them."
    )
  return new_tree


def relabel_variables(tree: Any, prefix: str) -> Any:
  """A copy of `tree` whose variables and slots have `prefix` put before their labels.

  Every variable is replaced by a new one holding the same value (a variable reachable
  twice becomes one new variable reachable twice); `tree` itself is left as it is.
  Labels identify variables, so two trees converted from models of the same
  architecture cannot be used together (a teacher inside a replacement, under
  `fl.variable_jit` or `stateless_call`) until one of them is relabelled.

  Example:
    >>> import flaxlens as fl
    >>> tree = fl.relabel_variables({"w": fl.Parameter(1.0, label="w")}, "teacher/")
    >>> tree["w"].label
    'teacher/w'
  """
  if not isinstance(prefix, str):
    raise ArgumentError(f"relabel_variables: prefix must be a string, got {prefix!r}.")
  made: dict[int, Any] = {}

  def relabel(x: Any) -> Any:
    if isinstance(x, AbstractVariableSlot):
      return type(x)(label=prefix + x.label)
    if not isinstance(x, AbstractVariable):
      return x
    if id(x) not in made:
      made[id(x)] = type(x)(x.value, label=prefix + x.label)
    return made[id(x)]

  return jax.tree_util.tree_map(relabel, tree, is_leaf=_is_variable_or_slot)


def freeze_variables(tree: Any, predicate: Callable[[AbstractVariable], bool] | None = None) -> Any:
  """Replaces bound variables in `tree` by their frozen values.

  A variable reachable twice becomes one frozen value reachable twice.

  Args:
    tree: a pytree holding variables.
    predicate: if given, only variables for which it returns True are frozen.

  Example:
    >>> import flaxlens as fl
    >>> fl.freeze_variables([fl.StateVariable(1, label="s")])
    [StateVariableValue(value=1, label='s')]
  """
  frozen: dict[int, AbstractVariableValue] = {}

  def freeze(x: Any) -> Any:
    if not isinstance(x, AbstractVariable) or (predicate is not None and not predicate(x)):
      return x
    if id(x) not in frozen:
      frozen[id(x)] = x.freeze()
    return frozen[id(x)]

  return jax.tree_util.tree_map(freeze, tree, is_leaf=_is_variable)


class Uninitialized(Struct):
  """Value of a state variable that the model creates during its first call.

  It has no pytree leaves; the node's call creates the variable as Flax would and
  writes the new value into the `StateVariable`.
  """


class Scratch:
  """Copies of a tree to run and throw away: each `copy()` has variable objects of its own,
  holding the tree's values (the arrays are shared, never written), so a run that writes
  state (a counter, batch statistics, a traced value under `jax.jit`) leaves the tree and
  the other copies alone. The variables are read once, here.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> from flaxlens.core._variables import Scratch, variables_in
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> copy = Scratch(tree).copy()
    >>> copy is tree, variables_in(copy)[0] is variables_in(tree)[0]
    (False, False)
  """

  def __init__(self, tree: Any):
    self.slots, self.values = unbind_variables(tree, freeze=True)

  def copy(self) -> Any:
    """A fresh copy of the tree, bound to variables of its own."""
    return bind_variables(self.slots, self.values)


def scratch_copy(tree: Any) -> Any:
  """One copy of `tree` to run and throw away (see `Scratch`)."""
  return Scratch(tree).copy()
