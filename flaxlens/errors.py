"""The errors flaxlens raises about a model, a tree, a call or a file.

Every one subclasses `FlaxlensError`, so one `except fl.FlaxlensError` catches them all;
each message names where it happened (a model path such as `Block_3/Dense_0.__call__`,
or a file) and ends with what to do. Where the same check used to raise a built-in error,
the class subclasses that built-in too, so older `except` clauses keep working.

- `UnsupportedFlaxFeatureError` (also `NotImplementedError`): the model or the call
  uses something flaxlens cannot convert or run exactly (lazy initialization, a call
  that changes static attributes, a call inside `nn.scan`/`nnx.vmap` run on its own),
  or the installed Flax or JAX lacks an internal flaxlens needs (raised at its first use,
  naming it and the supported versions). Fix: the message names the construct and what
  to do instead (initialize first, call the enclosing tree, install a supported Flax).
- `CallStructureError`: a run of the tree made other submodule calls than conversion
  saw where that matters: a replaced call was not made, a call that an intervention or
  capture names was not made (`fl.run`, `fl.capture`, sweeps), calls no longer line up
  with replaced ones, or the run created variables that did not exist at conversion.
  Fix: convert with example arguments that take the same branches; for interventions
  and captures of optional calls, `fl.run(..., unreached="ignore")`.
- `ReplacementError`: a replacement in `submodule_calls` is not callable, was removed,
  or returned output of another structure, dtype or shape than the call it replaces.
  Fix: replace the call with an `fl.Layer` that returns what the call returns.
- `ArgumentError` (also `TypeError` and `ValueError`): a tree, a call, a tool or a struct
  was given arguments of the wrong kind: a call not given `fl.ArgsAndKwargs`, a bad
  random stream, `Struct.from_attributes` with missing or unknown fields, `None` or a
  non-tree where a tool takes a tree, interventions or a metric, a tool (`fl.run`,
  `fl.capture`, `fl.sweep`, `fl.attribute`, `fl.grad_at`, `fl.fold`,
  `fl.check_equivalence`) called with the model's arguments spread over its own, an
  intervention's operand that is no value or holds nan or inf (named with its maker and
  site: `fl.steer('Block_0'): alpha='big' ...`, `fl.scale('mlp'): factor holds nan
  or inf. ...`), or a value, mask or index that does not fit
  its site: a `where=` or `index=` that reaches outside the value or selects nothing is
  refused naming the site, the axis, its size and the positions it allows
  (docs/interventions.md, index rules). Also: clean and corrupted arguments of
  another structure or other shapes (`fl.sweep`, `fl.attribute`, `fl.path_patch`),
  gradients taken at an integer-valued site or of a metric that is not a real float
  scalar, a capture `dtype=` that is no dtype, and a number JAX's 32-bit dtypes cannot
  hold. Fix: as the message says; the model's arguments
  are one value after the tree (one argument, a tuple, or
  `fl.ArgsAndKwargs.capture(*args, **kwargs)`).
- `VariableError` (also `ValueError`): a variable, slot or label was used inconsistently
  (two variables with one label, an unfilled slot), or a traced value would outlive its
  trace in a variable. Fix: relabel (`fl.relabel_variables`), pass the missing values,
  or run under `fl.variable_jit` instead of `jax.jit`.
- `HeadsError` (an `ArgumentError`): a head site (`fl.heads`, `fl.attention_pattern`)
  cannot split its call's value into heads: the head count does not divide the feature
  axis or is not a positive int, a head number is out of range, nobody gave the count
  (pass `heads=n`), or the attention module computes its pattern otherwise than Flax's
  own `dot_product_attention` (a custom `attention_fn`, decoding). Raised while the
  run is traced, before anything runs.
- `SelectionError` (also `KeyError` and `ValueError`): a selection found other nodes than
  asked for, or cannot make the edit asked for. Fix: the message lists what it found.
- `ExportError`: a tree cannot be exported as it is (a call was replaced or wrapped by a
  layer, which weights cannot express), the model given to update in place does not fit
  the tree, a saved exported model does not fit the model it is restored into, or
  `fl.fold` cannot express interventions in weights (or its result misses them beyond
  the tolerance, or its operands hold nan or inf). Fix: the message lists the patched
  calls, the variables that differ, or each unfoldable intervention with its reason.
- `ArtifactError`: an artifact could not be written, read or trusted (malformed,
  truncated, naming code from a package not allowed, or describing an intervention no
  `fl.` function would make). Fix: the message names the file and, for code, the
  `allow=[...]` that would load it.
- `BudgetError` (also `ValueError`): `budget=` (of `fl.run`, `fl.capture`, `fl.sweep`)
  cannot be kept: the captures of one example (one patched forward, for a sweep) do not
  fit, or the batch would have to be split where splitting cannot give the result of the
  whole batch (the run updates state, the array arguments do not share a leading size,
  an intervention's arrays hold the whole batch, or an example's values change when
  another example shares its chunk: the model couples the examples). Fix: the message
  lists the sizes per site or the reason; capture less (fewer sites, `index=`,
  `dtype=`), give a larger budget, or run without one (docs/interventions.md, budgets).
- `HarvestError`: `fl.harvest` cannot write its store where asked (the path is not a
  directory it can write, or holds something that is not a harvest store), the store
  there was made by another call (another model, sites, positions, dtype, ids or first
  batch: the message lists what differs, and nothing is overwritten), a batch
  mid-stream gives another feature shape or dtype than the store holds (the batches
  before it stay committed), the batches are empty, or a store that is not complete is
  read by an iterator (`Harvest.batches`, `Harvest.source`) without `partial=True`.
  Fix: run the same call again to resume, pass `overwrite=True` to start the store
  afresh, give another path, or make every batch alike; with TensorStore missing, the
  message says `pip install "flaxlens[harvest]"`.
- `StatisticsError` (also `ValueError`): a `SweepResult` statistic cannot be computed
  from what the result holds, or would not be finite and meaningful:
  `bootstrap()`/`p_values()` without per-example values or with one example,
  `normalised()` without the clean and corrupted metrics or with them equal within
  rounding, values that are inf or NaN (the rows and examples are named), a
  `confidence=` above `1 - 2 / 2**examples`, `bootstrap(normalised=True)` where a
  resample's clean and corrupted means agree or `clean - corrupted` changes sign too
  often, or a bad `n=`/`confidence=`/`permutations=`. Fix: sweep with
  `per_example=True` and a metric returning one value per example, sweep more examples,
  keep the examples whose corruption moves the metric, or bootstrap the raw values
  (docs/sweeps.md, how sure are we).
- `TrainingError`: `fl.train_interventions` stopped because the loss of a step became
  nan or inf. The message names the step; the error holds the step (`step`), the
  interventions with the last parameters whose loss was finite (`trained`) and the
  losses before it (`losses`). Fix: a smaller learning rate, gradient clipping
  (`optax.clip_by_global_norm`), or a loss that cannot divide by zero or take a log of 0
  on that step's batch.
- `ModelCallError` (also the class of the error it reports): a call of a converted tree
  failed inside the model's own code (Flax's or yours), for example token ids of another
  rank or a sequence longer than a positional table, which raise a bare `IndexError` or
  a broadcasting error deep inside the model. The message names the tree's call, the
  innermost converted call that was running (`transformer/wpe.__call__`), and the shapes
  and dtypes of the arguments conversion saw and this call passed, for the tree's call
  and that inner call. The error is raised from the original (`raise ... from e`): that
  one, with its traceback and attributes, is its `__cause__`; and it is an instance of
  the original's class too (an `IndexError` stays catchable as `except IndexError`), so
  code that caught the model's errors keeps working. Nothing is checked before a call:
  arguments of new shapes that the model accepts run as before, at no cost. Errors
  flaxlens raises itself (every `FlaxlensError`) and errors raised by a replacement
  layer you wrote pass through unchanged; an error raised by a function given to
  `fl.modify` is a `ModelCallError` of its class whose message names that function and
  the site, not the model's code. Fix: call the tree with
  arguments like those at conversion, or that the native model accepts, or convert it
  with such arguments.
  `fl.unflaxify` raises it too when the model's own code fails on the example arguments
  (`unflaxify(Model.__call__): conversion runs the model once on the example arguments,
  and the model's own code failed in layers/0.__call__ (...)`), naming the call being
  converted and the shapes it got; fix: convert with example arguments the model itself
  accepts.

One warning: `MetricRetraceWarning` (a `UserWarning`), given once per function code and
tool, when `fl.sweep`, `fl.attribute`, `fl.grad_at` or `fl.path_patch` trace and compile
again because the metric, a new function with the code of an earlier one, closes over
(or has as a default) another Python number or string, or another object compared by
identity; the message names the argument (`metric=`) and the value. Fix: close over
`jnp.asarray(value)` for a number that changes (arrays are inputs of the compiled
program), and reuse the same objects.

Public functions check the arguments they would otherwise hand to code that fails with a
bare `TypeError` (a path, a tree, a list of interventions, `allow=` given as None or as
something else; Linen variables lacking what the model reads): `ArgumentError` names the
function and the argument (`fl.load_isolated: path must be a file path (a str or
pathlib.Path), got None. ...`).
"""

from __future__ import annotations

import functools
from typing import Any


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


class HeadsError(ArgumentError):
  """A head site (`fl.heads`, `fl.attention_pattern`) cannot split its call's value into
  heads: a head count that is not a positive divisor of the feature axis, a head
  number out of range, a call whose head count nobody gave, or a pattern flaxlens
  cannot recompute as Flax does."""


class ArtifactError(FlaxlensError):
  """An artifact could not be written or read; the message says what and where."""


class HarvestError(FlaxlensError):
  """A harvest store cannot be written, resumed or read as asked; the message names the
  store's path and what differs."""


class ExportError(FlaxlensError):
  """A tree cannot be exported as it is (interventions that cannot be folded included), or
  an exported model cannot be saved or restored."""


class BudgetError(FlaxlensError, ValueError):
  """Work cannot be split to fit `budget=`: one example does not fit, or splitting the batch
  would not give the result of the whole batch."""


class StatisticsError(FlaxlensError, ValueError):
  """A statistic of a sweep or path patch cannot be computed from what its result holds,
  or would not be finite and meaningful: no per-example values, no clean and corrupted
  metrics, clean equal to corrupted (in the sample or in a resample), values that are
  not finite, too few examples for the confidence asked, or bad settings."""


class TrainingError(FlaxlensError):
  """A training run (`fl.train_interventions`) stopped: its loss became nan or inf.

  Attributes:
    step: the step (from 0) training stopped at: the step whose loss was not finite, or,
      where the last step's update made the learned arrays nan or inf, the step that
      would have started from them (the number of steps taken).
    trained: the interventions with the last parameters whose loss was finite (those step
      `step - 1` started from; the interventions as given where `step` is 0), in the
      order given, as `fl.train_interventions` returns them.
    losses: the loss of each step before `step` (a NumPy array, all finite).
  """

  def __init__(self, message: str, step: int, trained: list[Any], losses: Any):
    super().__init__(message)
    self.step = step
    self.trained = trained
    self.losses = losses

  def __reduce__(self) -> Any:
    return (type(self), (str(self), self.step, self.trained, self.losses))


class MetricRetraceWarning(UserWarning):
  """A tool traced and compiled again because a function argument (`metric=`), with the
  code of one it traced before, closes over another Python value or object."""


class ModelCallError(FlaxlensError):
  """A call of a converted tree (or a conversion) failed inside the model's own code.

  Each instance is also an instance of the original error's class (a subclass made once
  per class, named `ModelCallError[IndexError]`); the original is its `__cause__`.

  Example:
    >>> import flaxlens as fl, jax.numpy as jnp
    >>> from flax import nnx
    >>> tree = fl.unflaxify(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 3)))
    >>> try:
    ...   tree(fl.ArgsAndKwargs.capture(jnp.ones((1, 5))))
    ... except TypeError as e:
    ...   print(isinstance(e, fl.ModelCallError), type(e.__cause__).__name__)
    True TypeError
  """

  def __init__(self, message: str):
    BaseException.__init__(self, message)

  def __str__(self) -> str:
    return str(self.args[0]) if self.args else ""

  def __reduce__(self) -> Any:
    return (model_call_error, (_original_class(type(self)), str(self)))


def error_text(error: BaseException, limit: int = 400) -> str:
  """`error` as one line, `Type: message`, cut at `limit` characters (`...` after)."""
  said = " ".join(f"{type(error).__name__}: {error}".split())
  return said if len(said) <= limit else said[:limit] + " ..."


def model_call_error(original: type[BaseException], message: str) -> ModelCallError:
  """A `ModelCallError` saying `message` that is also an instance of `original`.

  The nearest class of `original`'s MRO that can be combined with `ModelCallError` is
  used (a class whose layout or constructor forbids it is skipped); `Exception` at
  worst.
  """
  for base in original.__mro__:
    if base in (Exception, BaseException) or issubclass(ModelCallError, base):
      break
    try:
      return _combined(base)(message)
    except Exception:
      continue
  return ModelCallError(message)


@functools.lru_cache(maxsize=256)
def _combined(base: type[BaseException]) -> type[ModelCallError]:
  name = f"ModelCallError[{base.__name__}]"
  return type(name, (ModelCallError, base), {"__module__": __name__, "__qualname__": name})


def _original_class(cls: type) -> type[BaseException]:
  bases = [b for b in cls.__bases__ if b is not ModelCallError]
  return bases[0] if bases else Exception
