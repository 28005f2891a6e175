"""The errors flaxlens raises about a model, a tree, a call or a file.

Every one subclasses `FlaxlensError`, so one `except fl.FlaxlensError` catches them all;
each message names where it happened (a model path such as `Block_3/Dense_0.__call__`,
or a file) and ends with what to do. Where the same check used to raise a built-in error,
the class subclasses that built-in too, so older `except` clauses keep working.

- `UnsupportedFlaxFeatureError` (also `NotImplementedError`): the model or the call
  uses something flaxlens cannot convert or run exactly (lazy initialization, a call
  that changes static attributes, a call inside `nn.scan`/`nnx.vmap` run on its own).
  Fix: the message names the construct and what to do instead (initialize first, call
  the enclosing tree, ...).
- `CallStructureError`: a run of the tree made other submodule calls than conversion
  saw where that matters: a replaced call was not made, calls no longer line up with
  replaced ones, or the run created variables that did not exist at conversion. Fix:
  convert with example arguments that take the same branches.
- `ReplacementError`: a replacement in `submodule_calls` is not callable, was removed,
  or returned output of another structure, dtype or shape than the call it replaces.
  Fix: replace the call with an `fl.Layer` that returns what the call returns.
- `ArgumentError` (also `TypeError` and `ValueError`): a function, a tree, a call or a
  struct was given arguments of the wrong kind: a path, a tree or a list of interventions
  given as None or as something else (`fl.load_isolated(None)`, `fl.summary(model)`,
  `fl.fold(tree, interventions=fl.steer(...))`), a call not given `fl.ArgsAndKwargs`, a bad
  random stream, Linen variables lacking what the model reads, `Struct.from_attributes`
  with missing or unknown fields. The message names the function and the argument. Fix:
  as the message says.
- `VariableError` (also `ValueError`): a variable, slot or label was used inconsistently
  (two variables with one label, an unfilled slot), or a traced value would outlive its
  trace in a variable. Fix: relabel (`fl.relabel_variables`), pass the missing values,
  or run under `fl.variable_jit` instead of `jax.jit`.
- `SelectionError` (also `KeyError` and `ValueError`): a selection found other nodes than
  asked for, or cannot make the edit asked for. Fix: the message lists what it found.
- `ExportError`: a tree cannot be exported as it is (a call was replaced or wrapped by a
  layer, which weights cannot express), the model given to update in place does not fit
  the tree, a saved exported model does not fit the model it is restored into, or
  `fl.fold` cannot express interventions in weights (or its result misses them beyond
  the tolerance). Fix: the message lists the patched calls, the variables that differ,
  or each unfoldable intervention with its reason.
- `ArtifactError`: an artifact could not be written, read or trusted (malformed,
  truncated, or naming code from a package not allowed). Fix: the message names the
  file and, for code, the `allow=[...]` that would load it.
"""

from __future__ import annotations


class FlaxlensError(Exception):
  """Base class of every error flaxlens raises about a model, a tree, a call or a file.

  Example:
    >>> import flaxlens as fl
    >>> class Pair(fl.Struct):
    ...   left: int
    ...   right: int
    >>> try:
    ...   Pair.from_attributes(left=1)
    ... except fl.FlaxlensError as e:
    ...   print(type(e).__name__)
    ArgumentError
  """


class UnsupportedFlaxFeatureError(FlaxlensError, NotImplementedError):
  """The model uses a Flax construct flaxlens cannot convert or run exactly."""


class CallStructureError(FlaxlensError):
  """A call of a converted tree made other submodule calls than at conversion."""


class ReplacementError(FlaxlensError):
  """A replacement in a tree is not a layer, or returned what its call cannot return."""


class ArgumentError(FlaxlensError, TypeError, ValueError):
  """A tree, a call or a struct was given arguments of the wrong kind."""


class VariableError(FlaxlensError, ValueError):
  """A variable, slot or label was used inconsistently, or would hold a leaked tracer."""


class SelectionError(FlaxlensError, KeyError, ValueError):
  """A selection found other nodes than asked for, or cannot make the edit asked for."""

  def __str__(self) -> str:
    return str(self.args[0]) if self.args else ""


class ArtifactError(FlaxlensError):
  """An artifact could not be written or read; the message says what and where."""


class ExportError(FlaxlensError):
  """A tree cannot be exported as it is (interventions that cannot be folded included), or
  an exported model cannot be saved or restored."""
