"""Attention heads as sites: edit, capture and sweep one head of a call without slicing.

`fl.heads(at)` names the heads of calls. On a Flax attention module
(`nn.MultiHeadDotProductAttention`, `nnx.MultiHeadAttention` and their subclasses) the
heads are the input of its `out` projection, `(..., heads, head_dim)`, which Flax
computes as the per-head values before merging them; on any other call they are its
output's (or input's) last axis read as `heads` groups of `head_dim` features, the head
count given as `heads=n` or read from the settings of the call's module or the nearest
enclosing one (`num_heads`, `n_head`, `num_attention_heads`, also under `config`),
unless the call's `DenseGeneral`/`LinearGeneral` module declares the value's last two
axes as `(heads, head_dim)`: then head `h` is `[..., h, :]`.
Every edit is the one edit concept (`core/_edit.py`): an intervention on a head site
resolves to the call holding the heads, and runs there on the value viewed as
`(..., heads, head_dim)`, keeping the heads it does not name; captures are edits that
record that view (`records`); `fl.attention_pattern` (`_attention_pattern.py`) reads
the same attention modules. A `Heads` site is a site object with every capability
(`tools/base/_site_objects.py`). Sweeps over heads (× positions) run as `fl.sweep`
does: one compiled program, the clean run once and every patched forward batched. No
Flax internals here:
which classes are Flax's attention (and `DenseGeneral`-like projections) and how their
weights are computed is each API's adapter's (`FrameworkAdapter.attention_class`,
`attention_weights`, ...); the head-count settings are read in `_head_settings.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._adapter import adapter_of
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._edit import Edit
from flaxlens.core._functions import jit_keyed_on_function
from flaxlens.core._node import CallNode
from flaxlens.core._probes import active_probing
from flaxlens.core._struct import Struct, static_field
from flaxlens.errors import ArgumentError, HeadsError
from flaxlens.tools.analysis._head_settings import (
  HEAD_COUNTS,
  check_settings_count,
  child_call,
  count_from_settings,
  count_holder,
  own_calls,
  settings_with_count,
  value_spec,
)
from flaxlens.tools.analysis._sweeps import (
  SitePatch,
  indexed_run,
  position_mask,
  row_labels,
  scan_iteration,
  sweep_forwards,
)
from flaxlens.tools.base._intervention import Intervention
from flaxlens.tools.base._parts import one_array, set_part
from flaxlens.tools.base._probed import Copies
from flaxlens.tools.base._site_objects import PathSites, SweepOptions, SweptUnits
from flaxlens.tools.base._sites import Site, select_sites, sites_of

# --- resolving a head site ----------------------------------------------------------------


class _Split(NamedTuple):
  """Where a head site's heads are: one call's value and how it splits.

  Attributes:
    name: the site `at` named (`"block_0/attn"`): results and rows are named after it.
    site: the call whose value holds the heads (an attention module's `out`).
    on: "input" (its first positional argument) or "output".
    count: the number of heads.
    merged: whether the value's last axis holds the heads merged (`heads * head_dim`);
      else its last two axes are `(heads, head_dim)`.
    heads: the heads named, in order (every head when none were).
    once: the value's shape per call, as conversion saw it.
  """

  name: str
  site: Site
  on: str
  count: int
  merged: bool
  heads: tuple[int, ...]
  once: tuple[int, ...]


def checked_heads(which: tuple[int, ...] | None, count: int, name: str) -> tuple[int, ...]:
  if which is None:
    return tuple(range(count))
  outside = [h for h in which if not -count <= h < count]
  if outside:
    raise HeadsError(
      f"{name}: heads {outside} are out of range; the call has {count} heads. Give head"
      f" numbers from 0 to {count - 1} (negative ones count from the end)."
    )
  out = tuple(h % count for h in which)
  if len(set(out)) < len(out):
    raise HeadsError(
      f"{name}: which={list(which)} names a head twice (of {count} heads). Name each head once."
    )
  return out


def _resolve(spec: Heads, tree: CallNode, sites: list[Site]) -> list[_Split]:
  """Where the heads of each call `spec.at` names are (see `_Split`).

  Raises:
    HeadsError: a head count that does not fit, a head out of range, no count known.
  """
  matched = select_sites(tree, spec.at, sites)
  attention = outermost([s for s in matched if attention_class(s) is not None])
  inside = {tuple(s.node.path) for s in attention}
  found = []
  for site in matched:
    path = tuple(site.node.path)
    if site not in attention and any(path[: len(p)] == p for p in inside):
      continue  # a call inside a named attention module: its heads are the module's
    found.append(_split(spec, site, sites, site in attention))
  return found


def attention_class(site: Site) -> type | None:
  """The Flax attention class the call's module is or subclasses (its adapter's), or None."""
  return adapter_of(site.node).attention_class(site.node.module_type)


def outermost(attention: list[Site]) -> list[Site]:
  """The attention calls not nested in another of them of the same module (the call a
  subclass's `super().__call__` makes is its outer call's)."""
  nested = {id(n) for s in attention for n in own_calls(s.node)[1:]}
  return [s for s in attention if id(s.node) not in nested]


def _split(spec: Heads, site: Site, sites: list[Site], attention: bool) -> _Split:
  given, on = spec.count, spec.on
  if attention:
    out = child_call(sites, site, "out")
    if out is None:
      raise HeadsError(
        f"{site.name}: this attention module made no call of its `out` projection that"
        " the tree can edit (it was replaced or placed). Name the heads on the call that"
        " holds them: fl.heads(path, heads=n, on='input')."
      )
    if on is not None:
      raise HeadsError(
        f"{site.name}: the heads of a Flax attention module are the input of its out"
        f" projection, (..., heads, head_dim), which fl.heads('{site.name}') names;"
        f" on={on!r} would name the module's own {on}, which holds no heads. Leave on="
        f" out, or name a projection: fl.heads('{site.name}/query')."
      )
    value = value_spec(out, "input")
    if value is None or len(value.shape) < 2:
      raise HeadsError(
        f"{site.name}: the input of its out projection is not one (..., heads, head_dim)"
        " array. Name the heads on the call that holds them with heads=n."
      )
    count = value.shape[-2]
    if given is not None and given != count:
      raise HeadsError(
        f"{site.name}: heads={given}, but this attention module has {count} heads (its"
        f" out projection's input has shape {tuple(value.shape)}). Leave heads= out, or"
        f" give heads={count}."
      )
    heads = checked_heads(spec.which, count, site.name)
    return _Split(site.name, out, "input", count, False, heads, tuple(value.shape))
  on = on or "output"
  _check_not_attention(sites, site, on)
  merged_by = _merges_heads(sites, site) if on == "output" else None
  if merged_by is not None:
    on_input = dataclasses.replace(spec, at=site.name, on="input")
    raise HeadsError(
      f"{site.name}: {merged_by}, so its output holds no heads: they exist only on its"
      f" input, where they are still apart. Name them there: {on_input!r}."
    )
  value = value_spec(site, on)
  if not isinstance(value, jax.ShapeDtypeStruct) or not value.shape:
    shown = "nothing" if value is None else type(value).__name__
    raise HeadsError(
      f"{site.name}: the {on} of this call is {shown}, not one array whose last axis holds"
      " heads. Name a call whose value is one array (a projection), or on='input'."
    )
  declared = _declared_axes(site, on, len(value.shape))
  if declared is not None and declared > 1:
    return _split_axis(spec, site, sites, on, value, declared)
  features = value.shape[-1]
  count = given
  if count is None:
    found = settings_with_count(sites, site)
    if found is not None:
      count = found[0]
      check_settings_count(site, on, features, *found)
  if count is None:
    raise HeadsError(
      f"{site.name}: no head count is known for this call (its module and the modules"
      f" around it have no num_heads, n_head or num_attention_heads setting), so its"
      f" {features} features cannot be split into heads. Pass heads=n to fl.heads."
    )
  if features % count:
    raise HeadsError(
      f"{site.name}: the {on}'s last axis has {features} features, which {count} heads do"
      f" not divide. Give the call's head count: a divisor of {features}"
      " (heads * head_dim = features)."
    )
  heads = checked_heads(spec.which, count, site.name)
  return _Split(site.name, site, on, count, True, heads, tuple(value.shape))


def _check_not_attention(sites: list[Site], site: Site, on: str) -> None:
  """Refuses a hand-written attention module (one with a head-count setting that calls
  other modules): its output comes after its heads are merged and projected, and its
  input before they are computed, so neither holds them."""
  settings = site.node.settings()
  holders = (settings, settings.get("config"))
  said = [
    k
    for holder in holders
    for k in HEAD_COUNTS
    if (holder.get(k) if isinstance(holder, dict) else getattr(holder, k, None)) is not None
  ]
  calls = [key[1].rsplit(".", 1)[0] for key in site.node.submodule_calls]
  if not said or not calls:
    return
  last = list(site.node.submodule_calls.values())[-1]
  out = next((s.name for s in sites if s.node is last), f"{site.name}/{calls[-1]}")
  raise HeadsError(
    f"{site.name}: this call's module has a {said[0]} setting and calls other modules"
    f" ({calls[:6]}): it looks like an attention module, but not one of Flax's"
    f" (nn.MultiHeadDotProductAttention, nnx.MultiHeadAttention), so flaxlens does not know"
    f" where its heads are; its {on} is not split into heads. Name the call that holds"
    f" them: the input of its output projection, fl.heads('{out}', h,"
    " on='input'), or a query/key/value projection's output."
  )


def _merges_heads(sites: list[Site], site: Site) -> str | None:
  """Why the structure of the model says `site`'s call merges heads (an attention
  output projection), or None. Two signs, either enough: its module declares its
  input's last two axes as the axes it contracts (a `DenseGeneral`/`LinearGeneral`
  with `axis=(-2, -1)`: `(heads, head_dim)` in, features out); or it is the last call
  holding parameters that the module with the head-count setting around it makes (that
  module computes the heads from its input and merges them in its last projection, as
  Flax's and Hugging Face's attention modules do)."""
  value = value_spec(site, "input")
  ndim = len(value.shape) if isinstance(value, jax.ShapeDtypeStruct) else 0
  if ndim >= 2 and (_declared_axes(site, "input", ndim) or 0) >= 2:
    axes = site.node.settings().get("axis")
    return f"its {site.node.module_type.__name__} contracts its input's axes {axes}"
  found = count_holder(sites, site)
  if found is None or tuple(found[0].node.path) == tuple(site.node.path):
    return None
  outer, _, (key, count) = found
  made = [
    layer
    for node in own_calls(outer.node)
    for layer in node.submodule_calls.values()
    if isinstance(layer, CallNode) and layer.scope_data.parameters
  ]
  if made and made[-1] is site.node:
    return (
      f"it is the last projection of {outer.name}, the module whose {key}={count} setting"
      " gives the head count (such a module merges its heads in its last projection)"
    )
  return None


def _declared_axes(site: Site, on: str, ndim: int) -> int | None:
  """How many trailing axes of a `DenseGeneral`/`LinearGeneral` call's value its module
  declares as features (`features`/`out_features` for its output, `axis` for its input),
  or None for another module (or contracted axes that are not the trailing ones)."""
  settings = site.node.settings()
  if not adapter_of(site.node).declares_trailing_features(site.node.module_type):
    return None
  if on == "output":
    features = settings.get("features", settings.get("out_features"))
    return len(features) if isinstance(features, tuple | list) else 1
  axis = settings.get("axis")
  axes = tuple(axis) if isinstance(axis, tuple | list) else (axis,)
  if not all(isinstance(a, int) for a in axes):
    return None
  normal = tuple(a % ndim for a in axes) if ndim else ()
  return len(axes) if normal == tuple(range(ndim - len(axes), ndim)) else None


def _split_axis(
  spec: Any, site: Site, sites: list[Site], on: str, value: Any, declared: int
) -> _Split:
  """The heads of a call whose module declares its value's trailing axes as
  `(heads, head_dim)` (a Flax attention module's query, key, value projections, the out
  projection's input): head `h` is `[..., h, :]`."""
  shape = tuple(value.shape)
  kind = "features" if on == "output" else "contracted axes (axis=)"
  if declared != 2:
    raise HeadsError(
      f"{site.name}: its module declares the {on}'s last {declared} axes {shape[-declared:]}"
      f" as its {kind}, so which of them holds the heads is ambiguous. Name a call whose"
      " value ends in (heads, head_dim), or one whose last axis holds heads * head_dim."
    )
  count = shape[-2]
  settings = count_from_settings(sites, site)
  for said, source in ((spec.count, "heads="), (settings, "the num_heads setting around it")):
    if said is not None and said != count:
      raise HeadsError(
        f"{site.name}: its module declares the {on}'s last axes {shape[-2:]} as its {kind}:"
        f" (heads, head_dim) with {count} heads, but {source} says {said}. Leave heads="
        f" out, or give heads={count}; to split another axis, name a call whose last axis"
        " holds heads * head_dim."
      )
  heads = checked_heads(spec.which, count, site.name)
  return _Split(site.name, site, on, count, False, heads, shape)


# --- the headed view ----------------------------------------------------------------------


def _headed(x: Any, split: _Split | _Layout, site: str) -> Any:
  """`x` viewed as `(..., heads, head_dim)`; checked against the value the call has."""
  shape = tuple(x.shape)
  if split.merged:
    if not shape or shape[-1] % split.count:
      raise HeadsError(
        f"{site}: the {split.on} has shape {shape}, whose last axis {split.count} heads do"
        " not divide. Give the call's head count (heads=n)."
      )
    return x.reshape(*shape[:-1], split.count, shape[-1] // split.count)
  if len(shape) < 2 or shape[-2] != split.count:
    raise HeadsError(
      f"{site}: the {split.on} has shape {shape}, not (..., {split.count}, head_dim)."
      " Convert the model with arguments of the shapes it runs with."
    )
  return x


class _Layout(NamedTuple):
  """How an edit reads a value's heads (the static part of `_Split`)."""

  on: str
  count: int
  merged: bool


def _layout(split: _Split) -> _Layout:
  return _Layout(split.on, split.count, split.merged)


class HeadEdit(Struct):
  """An intervention applied to some heads of a call's value, leaving the others.

  The value (its `part`) is viewed as `(..., heads, head_dim)`; the intervention edits
  the named heads of that view, `(..., len(heads), head_dim)` in the order named (its
  `where=` and operands read it so: a capture of the same head site patches it back),
  the other heads keep their values, and the result goes back in the value's own shape.

  Attributes:
    intervention: the edit, made for the headed view.
    on: "input" or "output" of the call.
    part: which part of a structured value holds the heads, or None.
    layout: how the value splits into heads.
    heads: the heads edited.
  """

  intervention: Intervention
  on: str = static_field()
  part: Any = static_field()
  layout: _Layout = static_field()
  heads: tuple[int, ...] = static_field()

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    target = one_array(value, self.part, site, self.on)
    headed = _headed(target, self.layout, site)
    if self.heads == tuple(range(self.layout.count)):
      new = self.intervention.edit(site, argument, headed)
    else:
      chosen = np.asarray(self.heads)
      edited = self.intervention.edit(site, argument, headed[..., chosen, :])
      new = headed.at[..., chosen, :].set(edited)
    return set_part(value, self.part, new.reshape(target.shape))


class HeadCapture(Struct):
  """An edit that records a call's value viewed as `(..., heads, head_dim)` (the heads
  named only) as the capture `key`, and changes nothing."""

  records = True
  part = None
  on: str = static_field()
  layout: _Layout = static_field()
  heads: tuple[int, ...] = static_field()
  key: str = static_field()
  shape: Any = static_field(default=None)

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    del argument
    probing = active_probing()
    if probing is not None:
      headed = _headed(value, self.layout, site)
      if len(self.heads) < self.layout.count:
        headed = headed[..., list(self.heads), :]
      probing.record(self.key, headed, self.shape)
    return value


# --- head sites ---------------------------------------------------------------------------


def static_site(at: Any) -> Any:
  if isinstance(at, CallNode):
    raise ArgumentError(
      f"fl.heads({at.where()}): give the call's path pattern ('{at.readable_path()[0]}'),"
      " a module class or a predicate: a call node is not kept by compiled runs."
    )
  return tuple(at) if isinstance(at, list) else at


def checked_which(which: Any, maker: str) -> tuple[int, ...] | None:
  if which is None:
    return None
  items = [which] if isinstance(which, int | np.integer) else which
  try:
    out = tuple(int(h) for h in np.asarray(items).reshape(-1))
  except (TypeError, ValueError):
    out = None
  if (
    out is None or isinstance(which, bool) or not np.issubdtype(np.asarray(items).dtype, np.integer)
  ):
    raise HeadsError(
      f"{maker}: which={which!r} names no heads. Give a head number, a list of them, or"
      " None (every head)."
    )
  if not out:
    raise HeadsError(f"{maker}: which= is empty. Give at least one head, or None (every head).")
  return out


@dataclasses.dataclass(frozen=True)
class Heads:
  """A head site: the heads of the calls `at` names (made by `fl.heads`).

  Interventions (`fl.ablate`, `fl.patch`, `fl.steer`, `fl.scale`, `fl.modify`) take it
  as their site, `fl.run`/`fl.capture` capture it (as `"<site>:heads"`, with a heads
  axis), and `fl.sweep` sweeps it one head at a time.

  Attributes:
    at: the site pattern, class or predicate.
    which: the heads named (None: every head).
    count: the head count the user gave (`heads=`), or None.
    on: "input" or "output" for a call that is not a Flax attention module, or None.

  Example:
    >>> import flaxlens as fl
    >>> site = fl.heads("block_*/attn", [0, 2])
    >>> site.which, site
    ((0, 2), fl.heads('block_*/attn', [0, 2]))
  """

  at: Any
  which: tuple[int, ...] | None = None
  count: int | None = None
  on: str | None = None

  def __repr__(self) -> str:
    shown = [repr(self.at) if isinstance(self.at, str) else getattr(self.at, "__name__", "…")]
    if self.which is not None:
      shown.append(repr(list(self.which)))
    if self.count is not None:
      shown.append(f"heads={self.count}")
    if self.on is not None:
      shown.append(f"on={self.on!r}")
    return f"fl.heads({', '.join(shown)})"

  def splits(self, tree: CallNode, sites: list[Site] | None = None) -> list[_Split]:
    return _resolve(self, tree, sites_of(tree) if sites is None else sites)

  def path_sites(self, tree: CallNode) -> PathSites:
    """`(calls, on, slices, heads)` naming these heads for `fl.path_patch` (as `fl.Sites`
    takes them): the calls holding the heads, one slice per head, the same in every
    call, and `{call: [(site, head) per slice]}` (`("block_0/attn", 2)`) naming rows as
    `fl.sweep` names them."""
    splits = self.splits(tree)
    layouts = {(s.on, s.count, s.merged, s.heads, s.once[-1]) for s in splits}
    if len(layouts) != 1:
      raise HeadsError(
        f"{self!r}: fl.path_patch takes heads that are the same slices of every call named,"
        f" and these calls hold them differently ({sorted(map(str, layouts))}). Name calls"
        " of one layout per fl.heads, or give fl.Sites with explicit where= slices."
      )
    on, count, merged, heads, features = layouts.pop()
    if merged:
      width = features // count
      where = [jnp.s_[..., h * width : (h + 1) * width] for h in heads]
    else:
      where = [jnp.s_[..., h, :] for h in heads]
    named = {s.site.name: [(s.name, h) for h in heads] for s in splits}
    return PathSites([s.site.name for s in splits], on, where, named)

  def edits_of(
    self, tree: CallNode, sites: list[Site], intervention: Intervention
  ) -> list[tuple[Site, Edit]]:
    """The call holding each named module's heads, and the edit it runs (`fl.run`)."""
    if intervention.on != "output":
      raise HeadsError(
        f"{intervention.at!r}: on= of a head site is fl.heads' own (fl.heads(at,"
        f" on='input')); the intervention's on={intervention.on!r} would name another"
        " value. Leave on= out of the intervention."
      )
    out = []
    for split in self.splits(tree, sites):
      inner = dataclasses.replace(intervention, on=split.on, part=None)
      layout = _layout(split)
      out.append((split.site, HeadEdit(inner, split.on, intervention.part, layout, split.heads)))
    return out

  def capture_edits(
    self, tree: CallNode, sites: list[Site], shape: Callable[[str, Any], Any] | None
  ) -> list[tuple[Site, Edit]]:
    """The edits that record each named module's heads as `"<site>:heads"` (`fl.run`)."""
    out = []
    for split in self.splits(tree, sites):
      key = f"{split.name}:heads"
      shaped = None if shape is None else functools.partial(shape, key)
      edit = HeadCapture(split.on, _layout(split), split.heads, key, shaped)
      out.append((split.site, edit))
    return out

  def sweep_units(
    self, tree: CallNode, clean: Any, corrupted: Any, metric: Any, options: SweepOptions
  ) -> SweptUnits:
    """`fl.sweep` over these heads: one row per head and iteration, named
    `"layers/attn[3] head 2"`, its `(site, head)` in `heads`."""
    if options.part is not None:
      raise HeadsError(
        f"{self!r}: part= is not taken by a heads sweep: the heads are one array (a Flax"
        " attention module's out projection input, or a call's value). Leave part= out."
      )
    splits = self.splits(tree)
    run = _sweep_compiled if options.jit else _sweep_heads
    values, rows, (clean_metric, corrupted_metric) = run(
      tree,
      clean,
      corrupted,
      self,
      metric,
      options.positions,
      options.axis,
      options.chunk_size,
      options.random_streams,
    )
    units = []
    for split, row in zip(splits, rows, strict=True):
      for index in np.ndindex(*row.shape[:-1]):
        label = split.name + (f"[{','.join(map(str, index))}]" if index else "")
        units.extend((label, h) for h in split.heads)
    names = tuple(f"{site} head {h}" for site, h in units)
    return SweptUnits(values, names, tuple(units), clean_metric, corrupted_metric)


def heads(at: Any, which: Any = None, *, heads: int | None = None, on: str | None = None) -> Heads:
  """Names attention heads as a site: edit, capture and sweep them without slicing.

  On a Flax attention module (`nn.MultiHeadDotProductAttention`, `nn.SelfAttention`,
  `nnx.MultiHeadAttention`, subclasses too) the heads are the input of its `out`
  projection, `(..., heads, head_dim)`: the values each head computes, before they are
  merged. On a `DenseGeneral`/`LinearGeneral` whose module declares the value's last two
  axes as `(heads, head_dim)` (Flax's query/key/value outputs; `on="input"`: the `out`
  projection's input), head `h` is `[..., h, :]`. On any other call they are the last
  axis of its output (or, `on="input"`, of its first positional argument) read as
  `heads` groups of `head_dim` features: a merged projection's output, or a Hugging Face
  `c_proj`'s input. A hand-written attention module (a head-count setting, calls of
  its own) is refused: name the call holding its heads. The head
  count is `heads=`, else the setting `num_heads`, `n_head` or `num_attention_heads`
  (also under `config`) of the call's module or the nearest module around it.

  An intervention on a head site edits the named heads of the value viewed as
  `(..., heads, head_dim)`: its operands and `where=` read the view of those heads,
  `(..., len(which), head_dim)` in the order named (`where=jnp.s_[:, 3]`: position 3;
  a steering vector of shape `(head_dim,)`: added to each), and the other heads keep
  their values. `fl.capture` returns that view as `"<site>:heads"` (so a capture of one
  run patches the same head site of another); `fl.sweep` patches one head at a time.

  Args:
    at: the site(s): a path pattern (`"block_*/attn"`), a module class or a predicate.
    which: a head number or a list of them (negative count from the end); None: all.
    heads: the head count of a call that is not a Flax attention module, where no
      setting says it.
    on: "output" (default) or "input", for a call that is not a Flax attention module.

  Returns:
    A `fl.Heads` site.

  Raises:
    HeadsError: (when the run is traced, before anything runs) a head count that does
      not divide the feature axis or disagrees with the module, a head out of range,
      no head count known, or the output of a call that merges heads (an attention
      output projection: its heads are on its input, `on="input"`).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> attn, x = nn.MultiHeadDotProductAttention(num_heads=4), jnp.ones((1, 3, 8))
    >>> tree = fl.unflaxify(attn, attn.init(jax.random.key(0), x), x)
    >>> _, cache = fl.capture(tree, x, at=fl.heads("MultiHeadDotProductAttention.__call__"))
    >>> cache["MultiHeadDotProductAttention.__call__:heads"].shape  # (batch, seq, heads, dim)
    (1, 3, 4, 2)
    >>> out = fl.run(tree, x, interventions=[fl.ablate(fl.heads("**", 2))])
  """
  maker = f"fl.heads({at!r})"
  if heads is not None and (
    not isinstance(heads, int | np.integer) or isinstance(heads, bool) or heads < 1
  ):
    raise HeadsError(
      f"{maker}: heads={heads!r} is no head count. Give the number of heads, a positive int."
    )
  if on not in (None, "input", "output"):
    raise HeadsError(f"{maker}: on= is 'output' or 'input', got {on!r}. Pass one of these.")
  return Heads(
    static_site(at), checked_which(which, maker), None if heads is None else int(heads), on
  )


# --- sweeps over heads --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _HeadPatcher:
  """The edit of one head site in every patched forward: the clean value at the head
  (and position) the forward's unit names, the corrupted value elsewhere."""

  name: str
  base: int
  lead: tuple[int, ...]
  layout: _Layout
  heads: tuple[int, ...]
  positions: tuple[int, ...] | None
  axis: int

  def __call__(self, argument: Any, value: Any, clean: Any, unit: Any, at: Any) -> Any:
    del argument
    found = scan_iteration(self.name, self.lead)
    if found is None:
      return value
    iterations, number = found
    if iterations:
      clean = clean[tuple(iterations)]
    headed = _headed(value, self.layout, self.name)
    n = len(self.heads)
    rel = unit - self.base - number * n
    head = jnp.asarray(self.heads)[jnp.clip(rel, 0, n - 1)]
    chosen = ((rel >= 0) & (rel < n)) & (jnp.arange(self.layout.count) == head)[:, None]
    if self.positions is not None:
      chosen = chosen & position_mask(self.name, headed, self.axis, self.positions, at)
    return jnp.where(chosen, clean, headed).reshape(value.shape)


def _sweep_heads(tree, clean, corrupted, spec, metric, positions, axis, chunk_size, streams):
  sites = sites_of(tree)
  splits = spec.splits(tree, sites)
  chosen = tuple(sites.index(s.site) for s in splits)
  copies = Copies(tree, chosen)
  copy, _ = copies.fresh()
  clean_output, cache = indexed_run(
    copy, clean, (), (dataclasses.replace(spec, which=None),), streams
  )
  leads, clean_values = [], []
  for split in splits:
    value = cache[f"{split.name}:heads"]
    once = len(split.once) + (1 if split.merged else 0)
    leads.append(tuple(value.shape[: value.ndim - once]))
    clean_values.append(value)
  units_of = [math.prod(lead) * len(s.heads) for s, lead in zip(splits, leads, strict=True)]
  bases = np.cumsum([0, *units_of]).tolist()
  patches = [
    SitePatch(
      s.on, None, value, _HeadPatcher(s.name, base, lead, _layout(s), s.heads, positions, axis)
    )
    for s, base, lead, value in zip(splits, bases, leads, clean_values, strict=False)
  ]
  values, baselines = sweep_forwards(
    copies, clean_output, patches, bases[-1], corrupted, metric, positions, chunk_size, streams
  )
  rows = row_labels([(*lead, len(s.heads)) for s, lead in zip(splits, leads, strict=True)])
  return values, rows, baselines


_sweep_compiled = jit_keyed_on_function(_sweep_heads, "metric", "fl.sweep")
