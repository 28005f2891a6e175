"""Probes: what one run of a tree does at chosen calls besides running them.

A `Probing` is attached to a run's `CallInterceptor`. For each probed call node it holds
the `EditedCall` layer the call runs through (`core/_edit.py`, the same layer `fl.place`
puts into a tree): the edits of the call's first argument and of its output, and
whether to capture them. Edits are plain functions of arrays, applied where the call
runs (inside `nn.scan`/`nnx.scan` bodies at every iteration), so they are traced into
the same program as the model.

Captured values must leave the trace they were made in. A value captured in the run's
own trace is returned as is. A value captured inside a body that JAX stages separately
(the body of `jax.lax.scan`, `jax.vmap`, `jax.checkpoint` that Flax's lifted transforms
call, and user code that calls them) is carried out as an extra output of that body:
while a capturing run is active, those names, looked up by the run's own code, give
wrappers under which each body opens a `Channel` and returns what was captured in it
beside its own output; `scan` and `vmap` stack it along a new leading axis. The
interception is scoped (`_thread_attributes.py`): JAX's functions stay in place, and a lookup from
another thread, or from this thread outside a capturing run, gets the original object;
the modules `jax` and `jax.lax` have a class of ours while at least one capturing run is
active in any thread (reference-counted, restored by the last run in `finally`).
A value captured in a trace no channel stands for (a body staged by a transform
flaxlens does not wrap) is not returned: the run raises `UnsupportedFlaxFeatureError`
naming the site.
An edited call the run never made (another branch than conversion took) would drop
its edits and captures: unless the run allows it, it raises `CallStructureError`.
A probing made `indexed` also wraps scans when it captures nothing, and gives each scan
body its iteration number, which edits read with `scan_iterations()` (to patch one
iteration of a call inside `nn.scan`/`nnx.scan`, say), and records, for each probed call,
the lengths of the scans it ran in (`enclosing`). A `OneIteration` edit applies its edit
at one iteration of the scans around its call only (the site `"layers[2]"`); the run
refuses one whose call runs in no scan, in a vmap, or has no such iteration. No Flax
internals here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax

from flaxlens._compat import tracing
from flaxlens.core._active import current_interceptor
from flaxlens.core._edit import Edit, EditedCall, RecordingEdit
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._thread_attributes import ScopedAttributes
from flaxlens.errors import CallStructureError, SelectionError, UnsupportedFlaxFeatureError


class Channel:
  """Values captured in one trace: the run's own, or one staged body's."""

  __slots__ = ("trace", "values")

  def __init__(self) -> None:
    self.trace = tracing.current_trace()
    self.values: dict[str, Any] = {}


class Probing:
  """The probes of one run and what they captured.

  Attributes:
    edited_calls: `{id(node): EditedCall}`: the layer each probed call runs through
      (`core/_edit.py`), overlaid on the tree for this run.
    capturing: whether any edited call captures, or has an edit that records captures
      (`records`, as the head captures of `fl.heads` do); then staged bodies are wrapped.
    indexed: whether edits read `scan_iterations()` (then staged bodies are wrapped).
    iterations: the iteration numbers of the scan bodies being traced, outermost first
      (None for a vmap body).
    lengths: the lengths of those scans (None for a vmap body), alike.
    enclosing: `{site: lengths}`: the scans (None: a vmap) each probed call ran in, in an
      indexed run: the most seen (a body Flax traces beforehand to learn shapes sees
      fewer).
    channels: the open channels, the run's own first.
    stray: `{site: where}` for values captured in a trace no channel carries out.
    reached: the names of the probes whose calls the run made (traced, that is: a call
      in a scan body that runs no iteration, or in either branch of a `lax.cond`, counts).
    unreached_fix: what the error for a required call the run did not reach tells the
      user to do.
    every_call: whether a site names every call and the run must then see them all: a
      run whose calls part from conversion's (`diverged`) runs the calls beyond that
      point natively, unseen, so it raises rather than miss them.
    diverged: where the run made a call conversion did not see, as call descriptions.
  """

  def __init__(
    self,
    edited_calls: dict[int, EditedCall],
    indexed: bool = False,
    unreached_fix: str = "Choose calls this run makes.",
    every_call: bool = False,
  ):
    self.edited_calls = edited_calls
    self.capturing = any(
      e.output or e.input or any(isinstance(x, RecordingEdit) and x.records for x in e.edits)
      for e in edited_calls.values()
    )
    self.indexed = indexed
    self.iterations: list[Any] = []
    self.lengths: list[int | None] = []
    self.enclosing: dict[str, tuple[int | None, ...]] = {}
    self.channels: list[Channel] = []
    self.stray: dict[str, str] = {}
    self.reached: set[str] = set()
    self.unreached_fix = unreached_fix
    self.every_call = every_call
    self.diverged: list[str] = []
    self.captured: dict[str, Any] = {}  # What the run captured, once it ran.

  def record(self, name: str, value: Any, shape: Callable[[Any], Any] | None = None) -> None:
    """Keeps `value` (its arrays, passed through `shape`) as the capture `name`."""
    value = jax.tree_util.tree_map(lambda x: x if _is_array(x) else None, value)
    if shape is not None:
      value = jax.tree_util.tree_map(shape, value)
    channel = self.channels[-1]
    if tracing.current_trace() == channel.trace:
      channel.values[name] = value
      self.stray.pop(name, None)
    else:
      self.stray[name] = "a body compiled separately"

  @contextmanager
  def channel(self) -> Iterator[Channel]:
    channel = Channel()
    self.channels.append(channel)
    try:
      yield channel
    finally:
      self.channels.remove(channel)

  def merge(self, values: dict[str, Any]) -> None:
    """Adds values a staged body carried out to the channel of the current trace."""
    channel = self.channels[-1]
    for name, value in values.items():
      if tracing.current_trace() == channel.trace:
        channel.values[name] = value
        self.stray.pop(name, None)
      else:
        self.stray[name] = "a body compiled separately"

  def results(self) -> dict[str, Any]:
    """What the run captured, by site.

    Raises:
      CallStructureError: for a required edited call the run did not make (it took
        another branch than conversion): its edits and captures would be dropped; or, when
        a site names every call, for calls the run made that conversion did not see.
      UnsupportedFlaxFeatureError: for values captured where they could not leave.
    """
    missed = [
      e.site for e in self.edited_calls.values() if e.required and e.site not in self.reached
    ]
    if missed:
      raise CallStructureError(
        f"This run did not make the call(s) {missed[:6]} that interventions or captures"
        " name (it took another branch than the example arguments at conversion), so"
        f" their edits and captures would be dropped. {self.unreached_fix}"
      )
    for edited in self.edited_calls.values():
      for edit in edited.edits:
        if isinstance(edit, OneIteration) and edited.site in self.reached:
          check_iteration(edited.site, edit.iteration, self.enclosing.get(edited.site, ()))
    if self.every_call and self.diverged:
      raise CallStructureError(
        f"This run made call(s) conversion did not see ({'; '.join(self.diverged[:3])}):"
        " the calls inside run natively and have no site in the tree, so editing or"
        f" capturing every call would miss them. {self.unreached_fix}"
      )
    if self.stray:
      sites = sorted(self.stray)
      raise UnsupportedFlaxFeatureError(
        f"The captured site(s) {sites[:6]} run inside a body JAX stages on its own that"
        " flaxlens cannot carry values out of: a loop or branch (lax.while_loop,"
        " fori_loop, cond, switch and the Flax transforms built on them), or an"
        " nnx.remat/nnx.vmap applied when the model was defined rather than in its"
        " forward pass. Interventions there work; capture the enclosing call instead."
      )
    return self.channels[0].values if self.channels else {}

  def note_enclosing(self, site: str) -> None:
    """Records the scans the call `site` runs in now (an indexed run's probed call)."""
    if self.indexed and len(self.lengths) >= len(self.enclosing.get(site, ())):
      self.enclosing[site] = tuple(self.lengths)


class OneIteration(Struct):
  """An edit applied at one iteration of the scans around its call only: the site
  `"layers[2]"` of an intervention. Needs an indexed run (`Probing(indexed=True)`).

  Attributes:
    wrapped: the edit applied at that iteration (an `Intervention`).
    iteration: the iteration of each enclosing scan, outermost first.
  """

  wrapped: Edit
  iteration: tuple[int, ...] = static_field()

  @property
  def on(self) -> str:
    return self.wrapped.on

  @property
  def part(self) -> Any:
    return self.wrapped.part

  def edit(self, site: str, argument: Any, value: Any) -> Any:
    """`value` edited where the enclosing scans are at `iteration`, else as it was."""
    iterations = scan_iterations()
    if len(iterations) != len(self.iteration) or any(i is None for i in iterations):
      return value  # a shape trace of a scan body, or a site the run refuses (`results`)
    chosen = functools.reduce(
      jax.numpy.logical_and, [i == k for i, k in zip(iterations, self.iteration, strict=True)]
    )
    edited = self.wrapped.edit(site, argument, value)
    return jax.tree_util.tree_map(
      lambda new, old: jax.numpy.where(chosen, new, old) if _is_array(old) else new,
      edited,
      value,
    )


def check_iteration(
  site: str, iteration: tuple[int, ...], enclosing: tuple[int | None, ...]
) -> None:
  """Refuses the iteration `iteration` (one number per scan) of the call at `site`, which
  ran in the scans of lengths `enclosing` (None for a vmap body).

  Raises:
    SelectionError: the call runs in no scan, in another number of scans, or the scans
      have no such iteration.
    UnsupportedFlaxFeatureError: the call runs in a vmap body.
  """
  name = f"{site}[{','.join(map(str, iteration))}]"
  if None in enclosing:
    raise UnsupportedFlaxFeatureError(
      f"{name}: this call runs inside a vmap body, which computes all its elements at"
      " once, so one of them cannot be addressed alone; only the iterations of scans"
      f" (nn.scan, nnx.scan, jax.lax.scan) can. Give the site {site!r} without the suffix."
    )
  if len(enclosing) != len(iteration):
    scans = f"{len(enclosing)} scan(s) of lengths {list(enclosing)}" if enclosing else "no scan"
    raise SelectionError(
      f"{name}: this call runs in {scans} that flaxlens numbers (nn.scan, nnx.scan,"
      f" jax.lax.scan), and the suffix gives {len(iteration)} iteration number(s). Give one"
      f" number per enclosing scan ({site}[i] for one scan, {site}[i,j] for two), or the"
      f" site {site!r} without the suffix."
    )
  outside = [(k, n) for k, n in zip(iteration, enclosing, strict=True) if not 0 <= k < n]
  if outside:
    raise SelectionError(
      f"{name}: the scan(s) around this call run {list(enclosing)} iteration(s), so"
      f" iteration {outside[0][0]} does not exist. Give iterations from 0 to"
      f" {outside[0][1] - 1}."
    )


def _is_array(x: Any) -> bool:
  return isinstance(x, jax.Array | jax.core.Tracer) or (
    hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)
  )


def active_probing() -> Probing | None:
  """The capturing (or indexed) probing of this thread's innermost run, or None."""
  interceptor = current_interceptor()
  probing = getattr(interceptor, "probing", None)
  if probing is None or not (probing.capturing or probing.indexed) or not probing.channels:
    return None
  return probing


def scan_iterations() -> tuple[Any, ...]:
  """The iteration numbers (traced scalars) of the scans enclosing the current call.

  Outermost first, None for an enclosing vmap body; empty outside such bodies. Only an
  `indexed` probing counts them, and only in the bodies JAX runs: a body Flax traces
  beforehand to learn its shapes (`nn.scan` does) sees fewer.
  """
  probing = active_probing()
  return tuple(probing.iterations) if probing is not None else ()


# --- carrying captured values out of staged bodies ------------------------------------


def _call_signature(function: Callable[..., Any]) -> inspect.Signature:
  """The parameters `function` takes: its own, or those of the function it wraps where it
  only passes `*args, **kwargs` on.

  Not simply `inspect.signature`, which reads the innermost wrapped function: jax < 0.10's
  `jax.remat` is a wrapper taking `concrete` (which flax 0.12.0 and 0.12.1 pass) around a
  `checkpoint` that does not.
  """

  def passes_on(candidate: Callable[..., Any]) -> bool:
    kinds = {p.kind for p in inspect.signature(candidate, follow_wrapped=False).parameters.values()}
    return kinds == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}

  return inspect.signature(
    inspect.unwrap(function, stop=lambda f: not passes_on(f)), follow_wrapped=False
  )


def _wrap_scan(original: Callable[..., Any]) -> Callable[..., Any]:
  signature = _call_signature(original)

  @functools.wraps(original)
  def scan(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    probing = active_probing()
    if probing is None:
      return original(f, *args, **kwargs)
    bound = signature.bind(f, *args, **kwargs)
    indexed = probing.indexed
    if indexed:  # the iteration number rides along with xs
      xs, length = bound.arguments.get("xs"), bound.arguments.get("length")
      if length is None:
        length = jax.tree_util.tree_leaves(xs)[0].shape[0]
      bound.arguments["xs"] = (xs, jax.numpy.arange(length))

    def body(carry: Any, x: Any) -> Any:
      if indexed:
        x, i = x
        probing.iterations.append(i)
        probing.lengths.append(length)
      try:
        with probing.channel() as channel:
          carry, y = f(carry, x)
      finally:
        if indexed:
          probing.iterations.pop()
          probing.lengths.pop()
      return carry, (y, channel.values)

    bound.arguments["f"] = body
    carry, (ys, captured) = original(*bound.args, **bound.kwargs)
    probing.merge(captured)
    return carry, ys

  return scan


def _wrap_mapped(original: Callable[..., Any], axes_argument: str | None) -> Callable[..., Any]:
  """Wraps a transform `original(fun, ...)` returning a function (vmap, checkpoint)."""
  signature = _call_signature(original)

  @functools.wraps(original)
  def transform(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    probing = active_probing()
    if probing is None:
      return original(fun, *args, **kwargs)
    bound = signature.bind(fun, *args, **kwargs)

    mapped = probing.indexed and axes_argument is not None

    def body(*a: Any, **k: Any) -> Any:
      if mapped:  # a vmap body: its elements have no iteration number
        probing.iterations.append(None)
        probing.lengths.append(None)
      try:
        with probing.channel() as channel:
          out = fun(*a, **k)
      finally:
        if mapped:
          probing.iterations.pop()
          probing.lengths.pop()
      return out, channel.values

    first = next(iter(signature.parameters))
    bound.arguments[first] = functools.wraps(fun)(body)
    if axes_argument is not None:
      axes = bound.arguments.get(axes_argument, signature.parameters[axes_argument].default)
      bound.arguments[axes_argument] = (axes, 0)
    transformed = original(*bound.args, **bound.kwargs)

    @functools.wraps(fun)
    def call(*a: Any, **k: Any) -> Any:
      out, captured = transformed(*a, **k)
      probing.merge(captured)
      return out

    return call

  return transform


_CARRYING_OUT = ScopedAttributes(
  {
    (jax.lax, "scan"): _wrap_scan,
    (jax, "vmap"): lambda f: _wrap_mapped(f, "out_axes"),
    (jax, "checkpoint"): lambda f: _wrap_mapped(f, None),
    (jax, "remat"): lambda f: _wrap_mapped(f, None),
  },
  lambda: active_probing() is not None,
)


def carrying_out() -> Any:
  """While active, staged bodies of JAX's scan, vmap and checkpoint carry captures out.

  Only for lookups of `jax.lax.scan`, `jax.vmap`, `jax.checkpoint` and `jax.remat` made
  in this thread while its innermost run captures (or is indexed); see `_thread_attributes.py`.
  """
  return _CARRYING_OUT.installed()
