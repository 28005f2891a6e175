"""Splicing: a call's output replaced by a module's reconstruction (an SAE, a transcoder).

`fl.splice` converts the spliced module (any Linen or NNX module: a sparse autoencoder,
a transcoder) on the call's value and places it in the tree as an edit of the call
(`Splice`, held by the call's `EditedCall`): the call's output becomes the module's
output on it (on its input, for a transcoder), plus the error term when asked. The
spliced module's tree is nested in the replaced call (`core/_walk.py: NESTED`), so its
calls are sites of the tree (`"Block_1/sae.encode"`), captured and intervened on like
any other, in the same run (`core/_runtime.py` runs a nested tree under the run's
probing). No Flax internals here.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from flaxlens.core._active import current_interceptor
from flaxlens.core._adapter import registered_adapters
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._probes import Probing
from flaxlens.core._runtime import run_tree
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._walk import own_call_nodes, pristine
from flaxlens.errors import ArgumentError, UnsupportedFlaxFeatureError
from flaxlens.tools.base._index import is_array
from flaxlens.tools.base._parts import checked_part, one_array, set_part
from flaxlens.tools.base._probed import placed
from flaxlens.tools.base._sites import (
  Called,
  Site,
  check_part,
  select_sites,
  several_methods,
  sites_of,
)


class Splice(Struct):
  """The edit `fl.splice` places: a call's output replaced by a nested tree's output.

  Attributes:
    module: the spliced module's converted tree (its calls are sites of the outer tree).
    at: the replaced call, named by its site name alone (`Called`: not a pattern,
      which for a module's `__call__` would also name its other methods).
    name: the spliced module's name among the sites (`"<at>/<name>"`).
    reads: "output" (a sparse autoencoder reads the call's output) or "input" (a
      transcoder reads the call's first positional argument).
    error: whether the error term (the call's output minus the reconstruction) is added
      back, so that the output is unchanged until the module's calls are edited.
    on: "output": the value replaced is the call's output.
    part: which part of a structured output is replaced (and, for a sparse autoencoder,
      read), or None for the whole output (the `part=` rule, `_parts.py`).
  """

  module: CallNode
  at: Any = static_field()
  name: str = static_field()
  reads: str = static_field(default="output")
  error: bool = static_field(default=True)
  on: str = static_field(default="output")
  part: Any = static_field(default=None)

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    """The call's new output: the reconstruction, plus the error term if kept.

    With the error term, an unedited module leaves the output `value` exactly; an edit
    of its calls (a feature ablated) gives `value - (clean - edited)`: the
    reconstruction's change, the clean reconstruction coming from a second run of the
    module that no edit reaches (`reconstruction + error` rounds otherwise).
    """
    if not pristine(self.module):
      raise UnsupportedFlaxFeatureError(
        f"{site}: the spliced module {self.name} holds edits placed in it (fl.place), which"
        " the error term cannot account for. Pass edits of its calls to fl.run"
        " (interventions=[...]) on the spliced tree instead."
      )
    target = one_array(value, self.part, site, self.on)
    read = target if self.reads == "output" else argument.args[0]
    edited = self._reconstruct(site, read, target)
    if not self.error:
      return set_part(value, self.part, edited)
    if not self._edited():
      return value
    clean = run_tree(
      self.module, ArgsAndKwargs(args=(read,), kwargs={}), None, {}, probing=Probing({})
    )
    return set_part(value, self.part, target - (clean - edited))

  def _reconstruct(self, site: str, read: Any, value: Any) -> Any:
    out = self.module(ArgsAndKwargs(args=(read,), kwargs={}))
    if getattr(out, "shape", None) != value.shape or out.dtype != value.dtype:
      shown = f"{out.dtype}{list(out.shape)}" if is_array(out) else type(out).__name__
      raise ArgumentError(
        f"{site}: the spliced module {self.name} returned {shown}, where the value it"
        f" replaces is {value.dtype}{list(value.shape)}. Splice a module whose call returns"
        " the reconstruction of that value (same shape and dtype)."
      )
    return out

  def _edited(self) -> bool:
    """Whether the run edits (not only captures) a call of the spliced module."""
    probing = getattr(current_interceptor(), "probing", None)
    if probing is None:
      return False
    nodes = {id(node) for node in own_call_nodes(self.module)}
    return any(layer.edits and key in nodes for key, layer in probing.edited_calls.items())


def _example(site: Site, part: Any, on: str, at: Any, sites: list[Site]) -> Any:
  """A zero array shaped as the array of the call's value (its `part`) that conversion
  saw (for converting the module), refused where that is not one array."""
  value = check_part(site, part, on, at, sites)
  if value is None:
    raise ArgumentError(
      f"fl.splice: conversion did not see the {on} of {site.name}, so the module cannot"
      " be converted on it. Splice a call the tree's conversion made."
    )
  return jnp.zeros(value.shape, value.dtype)


def splice(
  tree: CallNode,
  at: Any,
  module: Any,
  variables: Any = None,
  /,
  *,
  error: bool = True,
  reads: str = "output",
  name: str | None = None,
  part: Any = None,
) -> CallNode:
  """The tree with a call's output replaced by `module`'s output (a splice).

  A sparse autoencoder (`reads="output"`) maps the call's output to its reconstruction;
  a transcoder (`reads="input"`) maps the call's first argument to a replacement of its
  output. With `error=True` (default) the error term (the output minus the
  reconstruction) is added back, so the tree's output is unchanged, bit for bit, until
  a call of the spliced module is edited; then it changes by exactly the
  reconstruction's change (`output - (clean - edited)`). The module's calls become
  sites of the tree, named under the call: `"<at>/<name>"` for the module's call,
  `"<at>/<name>.encode"` for its other methods, `"<at>/<name>/Dense_0"` for its
  submodules; `fl.capture`, `fl.run` interventions (`fl.ablate(..., where=...)` of
  a feature) and sweeps take them like any other site.

  Args:
    tree: a converted tree.
    at: the one call to splice (a site, as `fl.run` takes them).
    module: a Linen module (with `variables`) or an NNX module whose call returns the
      reconstruction: an array of the call's output's shape and dtype.
    variables: the Linen module's variables (`module.init(...)`); None for NNX.
    error: add the error term back (default), or use the reconstruction alone.
    reads: "output" (an SAE) or "input" (a transcoder: the call's first argument).
    name: the module's name among the sites (default "sae", or "transcoder").
    part: for a call whose output is a tuple, dict or dataclass, which part is replaced
      (and, with `reads="output"`, read): `part=0` for a Hugging Face block's
      `(hidden_states, ...)`; the other parts are kept. None (default): the whole
      output, which must be one array. A transcoder reads the call's first argument
      whole. See docs/interventions.md, "Structured values: part=".

  Returns:
    A new tree; `tree` is not modified. Export refuses it, as any replaced call.

  Raises:
    SelectionError: `at` matches no call.
    ArgumentError: `at` names several calls, the call's value (its `part`) is not one
      array, or the module returns another shape or dtype than the value it replaces.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> class SAE(nn.Module):
    ...   def setup(self):
    ...     self.enc, self.dec = nn.Dense(12), nn.Dense(3)
    ...   def encode(self, x):
    ...     return nn.relu(self.enc(x))
    ...   def __call__(self, x):
    ...     return self.dec(self.encode(x))
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> sae = SAE()
    >>> spliced = fl.splice(tree, "layers_0", sae, sae.init(jax.random.key(1), jnp.ones((1, 3))))
    >>> out, cache = fl.capture(spliced, x, at="layers_0/sae.encode")
    >>> cache["layers_0/sae.encode"].shape, bool((out == fl.run(tree, x)).all())
    ((1, 12), True)
    >>> ablated = fl.run(spliced, x, interventions=[fl.ablate("layers_0/sae.encode")])
  """
  check_tree(tree, "fl.splice")
  if reads not in ("output", "input"):
    raise ArgumentError(
      f"fl.splice: reads= is 'output' (a sparse autoencoder) or 'input' (a transcoder),"
      f" got {reads!r}. Pass one of these."
    )
  if not isinstance(error, bool):
    raise ArgumentError(f"fl.splice: error= is True or False, got {error!r}.")
  name = name if name is not None else ("sae" if reads == "output" else "transcoder")
  if not isinstance(name, str) or not name or "/" in name or "." in name:
    raise ArgumentError(
      f"fl.splice: name= is the spliced module's name among the sites, a non-empty str"
      f" without '/' or '.', got {name!r}."
    )
  part = checked_part(part, "fl.splice")
  sites = sites_of(tree)
  found = select_sites(tree, at, sites)
  if len(found) != 1:
    several = several_methods(at, found[0], sites)
    listed = "" if several else f" ({[s.name for s in found][:6]})"
    raise ArgumentError(
      f"fl.splice: at={at!r} names {len(found)} calls{listed}; a spliced module"
      " reconstructs one call."
      + (f" {several}" if several else " Splice each call with its own module.")
    )
  site = found[0]
  output = _example(site, part, "output", at, sites)
  example = output if reads == "output" else _example(site, None, "input", at, sites)
  adapter = next((a for a in registered_adapters() if a.accepts(module)), None)
  if adapter is None:
    raise ArgumentError(
      f"fl.splice: module= is a {type(module).__name__}, not a Flax module. Give a"
      " flax.linen.Module (with its variables) or a flax.nnx.Module."
    )
  args = (example,) if variables is None else (variables, example)
  converted = adapter.convert(module, *args)
  edit = Splice(
    module=converted, at=Called(site.name), name=name, reads=reads, error=error, part=part
  )
  return placed(tree, (edit,), "fl.splice")
