"""Edited calls: the one way a call of a tree is changed, as a layer wrapping its node.

A tree changes what a call does in one way: a layer stands in for the call. A layer
placed with `select().apply(...)` may compute anything; an `EditedCall` is the layer
for edits given as data (interventions): it wraps the node of the call it edits, edits
the call's first positional argument, continues the call natively by calling that node,
and edits the output. The edits are pytree children, so the arrays they hold are leaves:
under `fl.variable_jit` (or `jax.jit` of a function taking the tree) new values reuse
one compiled program.

There are two ways to use one:
- placed in the tree (`fl.place`): an ordinary layer; it runs wherever its call runs,
  inside lifted transforms at every iteration, and export refuses the tree as it
  refuses any replaced call;
- for one run only (`fl.run`, `fl.capture`, sweeps): the run's `Probing` holds one per
  probed call, keyed by the call's node, and the dispatch hands that call to the layer's
  `around` with the native call as its continuation, exactly as a placed layer's call of
  its node continues the call. The tree is not rebuilt, so a compiled run's structure is
  the tree's and the sites'. Only an overlaid layer captures (a capture needs the run's
  channel, `_probes`).

An edit is any object the `Edit` protocol describes: `on` (`"input"` or `"output"`),
`part` and `edit(site, argument, value) -> value` (the tools' `Intervention`, a head
site's `HeadEdit`); an edit that also records captures in the run's probing
(`core/_probes.py: active_probing`) is a `RecordingEdit` with `records = True`. No Flax
internals here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._layer import Layer
from flaxlens.core._struct import static_field
from flaxlens.errors import UnsupportedFlaxFeatureError


@runtime_checkable
class Edit(Protocol):
  """What an `EditedCall` runs: one edit of a call's first positional argument or output.

  Attributes:
    on: `"input"` (the call's first positional argument, edited before the call) or
      `"output"` (edited after it).
    part: which part of a structured value the edit reads (a key, an index, a field
      name), or None for the whole value; tools check it against the call's recorded
      signature before anything runs.

  Example:
    >>> import jax.numpy as jnp
    >>> from flaxlens.extend import Edit
    >>> class Halve:
    ...   on, part = "output", None
    ...   def edit(self, site, argument, value):
    ...     return value / 2
    >>> isinstance(Halve(), Edit), Halve().edit("mlp", None, jnp.ones(2)).tolist()
    (True, [0.5, 0.5])
  """

  on: str
  part: Any

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    """The new value of the call's `on` value `value` (its arguments are `argument`);
    `site` names the call in messages."""
    ...


@runtime_checkable
class RecordingEdit(Edit, Protocol):
  """An edit that records captures in the run's probing (`active_probing()`), so the
  run keeps a channel for it; `records` is True."""

  records: bool


class EditedCall(Layer):
  """A call with edits of its first positional argument and of its output.

  Attributes:
    node: the call node it wraps (calling it continues the call natively).
    edits: `Edit`s, applied in order (the input edits before the call, the output edits
      after it).
    site: the call's name in messages and captured results (`"Block_0/mlp"`).
    output: whether to capture the output (after the edits); only in a run's overlay.
    input: whether to capture the positional arguments (after the edits); likewise.
    shape: a function applied to every captured array (slicing, dtype), or None.
    required: whether the run must make the call (else the edits and captures that
      asked for it would be dropped unseen); see `Probing.results`.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> placed = fl.place(tree, fl.ablate("layers_0"))
    >>> type(placed.submodule_calls[(0, "layers_0.__call__")]).__name__
    'EditedCall'
    >>> bool((placed(fl.ArgsAndKwargs.capture(x)) == fl.run(tree, x,
    ...       interventions=[fl.ablate("layers_0")])).all())
    True
  """

  node: Any
  edits: tuple[Edit, ...] = ()
  site: str = static_field(default="")
  output: bool = static_field(default=False)
  input: bool = static_field(default=False)
  shape: Any = static_field(default=None)
  required: bool = static_field(default=False)

  treescope_hidden_fields = ("output", "input", "shape", "required")

  def __call__(self, argument: Any, /, **side_inputs: Any) -> Any:
    """Placed in a tree: edits, continues the call by calling the wrapped node, edits."""
    return self.around(lambda a: self.node(a, **side_inputs), argument)

  def around(
    self, run: Callable[[ArgsAndKwargs], Any], argument: ArgsAndKwargs, probing: Any = None
  ) -> Any:
    """Runs the call through `run` (its continuation), with the edits around it and,
    when `probing` (the run's `Probing`) is given, the captures recorded in it."""
    if probing is not None:
      probing.reached.add(self.site)
      probing.note_enclosing(self.site)
    before = [e for e in self.edits if e.on == "input"]
    after = [e for e in self.edits if e.on != "input"]
    args, kwargs = tuple(argument.args), dict(argument.kwargs)
    if before:
      if not args:
        raise UnsupportedFlaxFeatureError(
          f"{self.node.where()}: an intervention on the input needs a positional argument,"
          " and this call got none. Intervene on the output of the call before it."
        )
      first = args[0]
      for edit in before:
        first = edit.edit(self.site, argument, first)
      args = (first, *args[1:])
      argument = ArgsAndKwargs(args=args, kwargs=kwargs)
    if self.input and probing is not None:
      probing.record(f"{self.site}:input", args[0] if len(args) == 1 else args, self.shape)
    output = run(argument)
    for edit in after:
      output = edit.edit(self.site, argument, output)
    if self.output and probing is not None:
      probing.record(self.site, output, self.shape)
    return output
