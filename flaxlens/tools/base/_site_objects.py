"""Site objects: sites that resolve themselves against a tree (`fl.heads`,
`fl.attention_pattern`, and any an extension writes).

A site pattern (a path glob, a class, a predicate) names whole calls; a site object names
a view of calls' values (some heads, some features, an attention pattern) and says
itself which calls it reads and which `Edit`s (`core/_edit.py`) they run. Every site
object can be captured (`SiteObject.capture_edits`); what else it can do is a smaller
protocol of its own, checked with `isinstance`: intervened on (`Intervenable`), swept one
unit at a time by `fl.sweep` (`Sweepable`), patched by `fl.path_patch` (`PathPatchable`).
A tool given a site object without the capability it needs refuses it
(`refuse_site_object`), naming the object and the method it lacks. No Flax internals here.

Add your own: a class with `capture_edits` (and the methods of the capabilities it has)
is a site object; subclassing the protocols is optional (they declare, they do not
implement). `tests/shared/test_own_site.py` writes one ("the first k features of a
call's output") and checks it against the same edits written natively.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

from flaxlens.core._edit import Edit
from flaxlens.core._node import CallNode
from flaxlens.errors import SelectionError

# `_sites` and `_intervention` import this module: a site (`Site`, one of `sites_of(tree)`)
# and an intervention (`Intervention`) are `Any` in the signatures here.
Site = Any


class SweepOptions(NamedTuple):
  """The options of `fl.sweep` a site object's sweep takes (as `fl.sweep` checked them).

  Attributes:
    positions: the positions swept (a tuple), or None for the whole value.
    axis: the axis of the positions.
    part: which part of a structured value to patch, or None.
    chunk_size: how many patched forwards run at once, or None (all).
    random_streams: the runs' random streams, resolved.
    jit: whether to compile the sweep.
  """

  positions: tuple[int, ...] | None
  axis: int
  part: Any
  chunk_size: int | None
  random_streams: Any
  jit: bool


class SweptUnits(NamedTuple):
  """What a site object's sweep returns to `fl.sweep`.

  Attributes:
    values: the metric per unit (and per position), units first.
    names: each row's name (`"layers/attn head 2"`).
    heads: each row's `(call, head)` where the rows are attention heads (drawn as a
      grid), else None.
    clean: the metric of the unpatched clean run.
    corrupted: the metric of the unpatched corrupted run.
  """

  values: Any
  names: tuple[str, ...]
  heads: tuple[tuple[str, int], ...] | None
  clean: Any
  corrupted: Any


class PathSites(NamedTuple):
  """A site object as `fl.path_patch` takes it (what `fl.Sites` holds).

  Attributes:
    calls: the names of the calls holding the units.
    on: `"input"` or `"output"` of those calls.
    where: one index (`jnp.s_[...]`) per unit, the same in every call.
    heads: `{call: [(call, head) per unit]}` where the units are attention heads (the
      rows are named as `fl.sweep` names them), else `{}`.
  """

  calls: list[str]
  on: str
  where: list[Any]
  heads: dict[str, list[tuple[str, int]]]


@runtime_checkable
class SiteObject(Protocol):
  """A site that resolves itself against a tree; it can always be captured.

  Example:
    >>> import flaxlens as fl
    >>> from flaxlens.extend import SiteObject, Sweepable
    >>> isinstance(fl.heads("attn"), SiteObject), isinstance("attn", SiteObject)
    (True, False)
    >>> isinstance(fl.attention_pattern("attn"), Sweepable)
    False
  """

  def capture_edits(
    self, tree: CallNode, sites: list[Site], shape: Callable[[str, Any], Any] | None
  ) -> list[tuple[Site, Edit]]:
    """The calls to capture and, for each, the `RecordingEdit` that records the view
    under its own key (`"<site>:heads"`); `shape(key, array)`, when given, slices and
    casts each recorded array (`fl.run`'s `index=`/`dtype=`)."""
    ...


@runtime_checkable
class Intervenable(SiteObject, Protocol):
  """A site object interventions (`fl.ablate`, `fl.patch`, ...) can take as their site."""

  def edits_of(
    self, tree: CallNode, sites: list[Site], intervention: Any
  ) -> list[tuple[Site, Edit]]:
    """The calls `intervention` edits and the `Edit` each runs (its `part` is checked
    against the call's recorded signature)."""
    ...


@runtime_checkable
class Sweepable(SiteObject, Protocol):
  """A site object `fl.sweep` sweeps one unit (a head, a feature) at a time."""

  def sweep_units(
    self, tree: CallNode, clean: Any, corrupted: Any, metric: Any, options: SweepOptions
  ) -> SweptUnits:
    """`fl.sweep` of these units: `clean` and `corrupted` are the model's arguments
    (`ArgsAndKwargs`), `metric` a function of the output."""
    ...


@runtime_checkable
class PathPatchable(SiteObject, Protocol):
  """A site object `fl.path_patch` takes as senders or receivers."""

  def path_sites(self, tree: CallNode) -> PathSites:
    """The calls, side and one slice per unit naming these units."""
    ...


@runtime_checkable
class NestsTree(Protocol):
  """An edit holding a converted tree it runs (`fl.splice`'s module): that tree's calls
  are sites of the run too, named under the edited call by `name`."""

  module: CallNode
  name: str


_CAPABILITIES = {
  Intervenable: ("edits_of", "intervened on"),
  Sweepable: ("sweep_units", "swept"),
  PathPatchable: ("path_sites", "path-patched"),
}


def refuse_site_object(at: Any, capability: type, where: str) -> SelectionError:
  """The refusal of site object `at` by `where` (`"fl.sweep"`), which needs `capability`
  (`Sweepable`) that `at` lacks."""
  method, done = _CAPABILITIES[capability]
  return SelectionError(
    f"{where}: the site object {at!r} cannot be {done}: it has no {method} (the"
    f" {capability.__name__} protocol of flaxlens.extend). Give a site"
    f" pattern or a site object that implements {method}."
  )
