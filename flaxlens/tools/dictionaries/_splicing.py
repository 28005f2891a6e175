"""Dictionaries in a tree: `splice` puts an SAE, a transcoder or a cross-layer
transcoder (CLT) into a converted tree, with its features as sites.

An SAE (at a site) and a transcoder (at an MLP call, reading its input) are placed as
`fl.splice`'s edit (`Splice`) as they are (a dictionary's call returns the
reconstruction), their variables labelled under the site, so that dictionaries spliced
at several calls (a transcoder per MLP) run together compiled.

A CLT crosses calls: features born at call `l` write into the outputs of calls `l..L-1`.
It is spliced as one edit per call (`LayerSplice`, placed like `fl.splice`'s edit):
- the edit of call `l` holds layer `l`'s encoder as a nested converted tree (a small
  NNX module, `LayerEncoder`, with that layer's slice of the weights and activation
  state), run on the call's input, so layer `l`'s features are sites
  `"<at_l>/<name>"` and `"<at_l>/<name>/activation"`, captured and edited with the
  ordinary tools in the same run;
- it puts those features into a run-scoped store (`_RUNS`: keyed weakly by the run's
  interceptor, so each run, traced or eager, has its own and it dies with the run) and
  reads the features layers `0..l` stored there, in this run, to rebuild the call's
  output: `sum_{k<=l} f_k @ W_dec[k][:, l-k] + b_dec[l]` (plus `x_l @ W_skip[l]`);
- with the error term, an unedited CLT leaves the output `value` as it is (bit for
  bit); once any layer's features are edited, the output changes by the
  reconstruction's change, `value - (clean - edited)`, the clean features coming from
  a run of each edited layer's encoder that no edit reaches (as `fl.splice` does).
The last layer's edit, or any failure, drops the run's entry (`finally`). The calls must
run in the order of `at` within one trace (a call inside an inner `jax.jit` of the model
cannot hand its features to a call outside it). No Flax internals here.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from flaxlens.core._active import current_interceptor
from flaxlens.core._adapter import registered_adapters
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._probes import Probing
from flaxlens.core._runtime import run_tree
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._variables import relabel_variables
from flaxlens.core._walk import own_call_nodes, pristine
from flaxlens.errors import ArgumentError, UnsupportedFlaxFeatureError
from flaxlens.tools.analysis._splice import Splice
from flaxlens.tools.base._parts import one_array
from flaxlens.tools.base._probed import capture, placed
from flaxlens.tools.base._sites import Called, Site, check_part, select_sites, sites_of
from flaxlens.tools.dictionaries._activations import make_activation
from flaxlens.tools.dictionaries._modules import CrossLayerTranscoder, Dictionary

DEFAULT_NAMES = {"sae": "sae", "transcoder": "transcoder", "clt": "clt"}


class LayerEncoder(nnx.Module):
  """One layer of a CLT's encoder: features `activation(x @ W_enc + b_enc)`.

  Args:
    clt: the cross-layer transcoder.
    layer: which layer (`0..layers-1`); its weights and activation state are copied.
  """

  def __init__(self, clt: CrossLayerTranscoder, layer: int):
    config = clt.config
    self.W_enc = nnx.Param(clt.W_enc[layer])
    self.b_enc = nnx.Param(clt.b_enc[layer])
    self.activation = make_activation(
      config.activation,
      (config.width,),
      k=config.k,
      threshold=config.threshold,
      bandwidth=config.bandwidth,
      momentum=config.momentum,
      dtype=jnp.dtype(config.dtype),
    )
    # Per-layer state (a JumpReLU threshold, `[layers, width]`) is sliced; state shared
    # by the layers (a BatchTopK threshold, a scalar) is copied.
    nnx.update(
      self.activation,
      jax.tree.map(
        lambda mine, theirs: theirs[layer] if theirs.ndim == mine.ndim + 1 else theirs,
        nnx.state(self.activation),
        nnx.state(clt.activation),
      ),
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    """The layer's features for its input `x` (`[..., d_in]` -> `[..., width]`)."""
    return self.activation(x @ self.W_enc[...] + self.b_enc[...])


class _Features(NamedTuple):
  edited: Any  # the features as this run computed them (its edits applied)
  clean: Any  # the features no edit reached (`edited` itself where none did)
  changed: bool  # whether an edit of the run reached the layer's encoder


# {run's interceptor: {splice token: {layer: _Features}}}; see the module docstring.
_RUNS: weakref.WeakKeyDictionary[Any, dict[Any, dict[int, _Features]]] = weakref.WeakKeyDictionary()


class LayerSplice(Struct):
  """The edit `splice` places at call `layer` of a CLT: the call's output rebuilt from
  the features of layers `0..layer` (see the module docstring).

  Attributes:
    module: layer `layer`'s encoder, a converted tree (its calls are sites).
    decoders: `W_dec[k][:, layer - k]` for `k = 0..layer`, each `[width, d_out]`.
    bias: `b_dec[layer]`.
    skip: `W_skip[layer]`, or None without a skip.
    at: the call, by its site name (`Called`).
    name: the encoder's name among the sites (`"<at>/<name>"`).
    layer: which layer of the CLT the call is.
    layers: how many layers the CLT spans.
    token: one object shared by the edits of one splice (their key in the run's store).
    error: whether the error term is added back.
  """

  module: CallNode
  decoders: tuple[Any, ...]
  bias: Any
  skip: Any
  at: Any = static_field()
  name: str = static_field()
  layer: int = static_field()
  layers: int = static_field()
  token: Any = static_field()
  error: bool = static_field(default=True)
  on: str = static_field(default="output")
  part: Any = static_field(default=None)

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    """The call's new output; stores this layer's features for the later calls."""
    if not pristine(self.module):
      raise UnsupportedFlaxFeatureError(
        f"{site}: the spliced CLT layer {self.name} holds edits placed in it (fl.place),"
        " which the error term cannot account for. Pass edits of its features to fl.run"
        " (interventions=[...]) instead."
      )
    target = one_array(value, None, site, "output")
    if not argument.args:
      raise ArgumentError(
        f"{site}: a CLT layer reads the call's first positional argument, and this call"
        " got none. Splice calls that take their input positionally (the MLPs)."
      )
    interceptor = current_interceptor()
    runs = _RUNS.setdefault(interceptor, {})
    last = self.layer == self.layers - 1
    try:
      stored = runs.setdefault(self.token, {})
      if self.layer == 0:
        stored.clear()
      x = argument.args[0]
      stored[self.layer] = self._features(x, interceptor)
      missing = [k for k in range(self.layer) if k not in stored]
      if missing:
        raise ArgumentError(
          f"{site}: this call is layer {self.layer} of the spliced CLT {self.name}, and"
          f" layers {missing} did not run before it in this run. Give at= the calls in the"
          " order the model makes them, all in one run (not inside an inner jit)."
        )
      layers = [stored[k] for k in range(self.layer + 1)]
      edited = self._reconstruct(x, [f.edited for f in layers])
      if not self.error:
        return edited
      if not any(f.changed for f in layers):
        return value
      return target - (self._reconstruct(x, [f.clean for f in layers]) - edited)
    except BaseException:
      last = True  # a failed run leaves nothing behind
      raise
    finally:
      if last:
        runs.pop(self.token, None)

  def _features(self, x: Any, interceptor: Any) -> _Features:
    edited = self.module(ArgsAndKwargs(args=(x,), kwargs={}))
    probing = interceptor.probing  # None in a run without interventions or captures
    nodes = {id(node) for node in own_call_nodes(self.module)}
    changed = probing is not None and any(
      layer.edits and key in nodes for key, layer in probing.edited_calls.items()
    )
    if not changed:
      return _Features(edited, edited, False)
    clean = run_tree(
      self.module, ArgsAndKwargs(args=(x,), kwargs={}), None, {}, probing=Probing({})
    )
    return _Features(edited, clean, True)

  def _reconstruct(self, x: Any, features: Sequence[Any]) -> Any:
    """`sum_k features[k] @ decoders[k] + bias` (in `CrossLayerTranscoder.decode`'s
    order), plus the skip."""
    out = self.bias
    for source, decoder in zip(features, self.decoders, strict=True):
      out = out + source @ decoder
    return out if self.skip is None else out + x @ self.skip


def _one_site(tree: CallNode, at: Any, sites: list[Site], what: str) -> tuple[Site, Any]:
  """The one call `at` names, and its output as conversion saw it."""
  found = select_sites(tree, at, sites)
  if len(found) != 1:
    raise ArgumentError(
      f"fld.splice: {what}={at!r} names {len(found)} calls"
      f" ({[s.name for s in found][:6]}); a dictionary reads one call. Give one site."
    )
  output = check_part(found[0], None, "output", at, sites)
  if output is None:
    raise ArgumentError(
      f"fld.splice: conversion did not see the output of {found[0].name}. Splice a call"
      " the tree's conversion made."
    )
  return found[0], output


def _call_input(site: Site, what: str) -> Any:
  """The first positional argument of `site`'s call as conversion saw it, refused where
  the call takes none or it is not one array."""
  args = jax.tree_util.tree_unflatten(*site.inputs)[0] if site.inputs is not None else ()
  if not args:
    raise ArgumentError(
      f"fld.splice: {what} reads the first positional argument of {site.name}, and this"
      " call takes none (or conversion did not see it). Splice a call that takes its input"
      " positionally (the MLP itself, not a wrapper called with keywords)."
    )
  return one_array(args[0], None, site.name, "input")


def _check_width(site: Site, value: Any, width: int, dtype: str, reads: str, what: str) -> None:
  """Refuses a dictionary whose `width` (its d_in or d_out) or dtype does not fit `value`,
  the call's input or output (`reads`)."""
  if value.shape[-1:] != (width,) or value.dtype != jnp.dtype(dtype):
    raise ArgumentError(
      f"fld.splice: the dictionary's {what} is {width} ({dtype}), but the {reads} of"
      f" {site.name} is {value.dtype}{list(value.shape)}. Splice it at a call whose"
      f" {reads} has {width} features on the last axis and dtype {dtype}, or build the"
      " dictionary for this call."
    )


def splice(
  tree: CallNode,
  dictionary: Dictionary,
  at: Any,
  *,
  error: bool = True,
  name: str | None = None,
) -> CallNode:
  """The tree with a dictionary spliced in: its features become sites.

  - An SAE (`config.kind == "sae"`) replaces the output of the call `at` by its
    reconstruction (as `fl.splice` does); features: `"<at>/sae/activation"`.
  - A transcoder replaces the output of the call `at` (an MLP) by its prediction from
    the call's input; features: `"<at>/transcoder/activation"`.
  - A CLT takes `at` as a list of its `layers` calls (the MLPs, in layer order): layer
    `l`'s features read call `l`'s input, and call `j`'s output becomes the sum of the
    decodes of layers `0..j` plus `b_dec[j]` (and the skip); features of layer `l`:
    `"<at_l>/clt/activation"` (see the module docstring for how calls hand features on).

  With `error=True` (default) the error term is added back: the tree's output is
  unchanged, bit for bit, until a feature is edited, and then changes by exactly the
  reconstruction's change. `fl.capture`, `fl.run` interventions (`fl.ablate(site,
  where=jnp.s_[..., i])` for feature `i`), eager or compiled, take the feature sites.

  Args:
    tree: a converted tree.
    dictionary: an `SAE`, `Transcoder` or `CrossLayerTranscoder` (any `Dictionary`).
    at: the call (a site), or for a CLT a list of `layers` calls in layer order.
    error: add the error term back (default), or use the reconstruction alone.
    name: the dictionary's name among the sites (default "sae", "transcoder", "clt").

  Returns:
    A new tree; `tree` is not modified.

  Raises:
    ArgumentError: `at` names no call or several, has the wrong length for a CLT, or is
      not in call order; a call's input or output does not have the dictionary's width
      or dtype; a transcoder's or CLT's call takes no positional input.

  Example:
    >>> import flaxlens as fl, flaxlens.dictionaries as fld, jax.numpy as jnp
    >>> from flax import nnx
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs))
    >>> x = jnp.ones((2, 4))
    >>> tree = fl.unflaxify(model, x)
    >>> clt = fld.CrossLayerTranscoder(2, 4, 4, 8, rngs=nnx.Rngs(2))
    >>> spliced = fld.splice(tree, clt, ["layers/0", "layers/1"])
    >>> out, cache = fl.capture(spliced, x, "layers/1/clt/activation")
    >>> bool((out == model(x)).all()), cache["layers/1/clt/activation"].shape
    (True, (2, 8))
  """
  check_tree(tree, "fld.splice")
  if not isinstance(dictionary, Dictionary):
    raise ArgumentError(
      f"fld.splice: dictionary= is a {type(dictionary).__name__}, not a fld.Dictionary."
      " Give an fld.SAE, fld.Transcoder or fld.CrossLayerTranscoder (or use fl.splice for"
      " another module)."
    )
  if not isinstance(error, bool):
    raise ArgumentError(f"fld.splice: error= is True or False, got {error!r}.")
  config = dictionary.config
  name = DEFAULT_NAMES[config.kind] if name is None else name
  if not isinstance(name, str) or not name or "/" in name or "." in name:
    raise ArgumentError(
      f"fld.splice: name= is the dictionary's name among the sites, a non-empty str"
      f" without '/' or '.', got {name!r}."
    )
  sites = sites_of(tree)
  if config.kind == "clt":
    return _splice_clt(tree, dictionary, at, sites, error, name)
  site, output = _one_site(tree, at, sites, "at")
  _check_width(site, output, config.d_out, config.dtype, "output", "d_out")
  read = output if config.kind == "sae" else _call_input(site, "a transcoder")
  _check_width(site, read, config.d_in, config.dtype, "input", "d_in")
  edit = Splice(
    module=_converted(dictionary, read, f"{site.name}/{name}/"),
    at=Called(site.name),
    name=name,
    reads="output" if config.kind == "sae" else "input",
    error=error,
  )
  return placed(tree, (edit,), "fld.splice")


def _converted(module: nnx.Module, example: Any, prefix: str) -> CallNode:
  """`module` converted on zeros shaped as `example`, its variables labelled under
  `prefix` (the site it is spliced at), so that dictionaries spliced at several calls
  keep distinct labels (`fl.variable_jit`, `fl.run(..., jit=True)` need them)."""
  adapter = next(a for a in registered_adapters() if a.accepts(module))
  return relabel_variables(adapter.convert(module, jnp.zeros(example.shape, example.dtype)), prefix)


def _splice_clt(
  tree: CallNode,
  clt: Dictionary,
  at: Any,
  sites: list[Site],
  error: bool,
  name: str,
) -> CallNode:
  config = clt.config
  if isinstance(at, str) or not isinstance(at, Sequence) or len(at) != config.layers:
    raise ArgumentError(
      f"fld.splice: a CLT of {config.layers} layers takes at= as a list of {config.layers}"
      f" calls (its MLPs, in layer order), got {at!r}. Give one site per layer."
    )
  chosen = [_one_site(tree, pattern, sites, f"at[{layer}]") for layer, pattern in enumerate(at)]
  order = [next(i for i, s in enumerate(sites) if s is site) for site, _ in chosen]
  if order != sorted(set(order)):
    raise ArgumentError(
      f"fld.splice: at= names {[s.name for s, _ in chosen]}, which are not distinct calls"
      " in the order the model makes them. Give the CLT's calls in layer order."
    )
  token = object()
  edits = []
  for layer, (site, output) in enumerate(chosen):
    _check_width(site, output, config.d_out, config.dtype, "output", "d_out")
    x = _call_input(site, "a CLT layer")
    _check_width(site, x, config.d_in, config.dtype, "input", "d_in")
    encoder = _converted(LayerEncoder(clt, layer), x, f"{site.name}/{name}/")
    edits.append(
      LayerSplice(
        module=encoder,
        decoders=tuple(clt.W_dec[k][:, layer - k] for k in range(layer + 1)),
        bias=clt.b_dec[layer],
        skip=clt.W_skip[layer] if config.skip else None,
        at=Called(site.name),
        name=name,
        layer=layer,
        layers=config.layers,
        token=token,
        error=error,
      )
    )
  return placed(tree, tuple(edits), "fld.splice")


class Replacement(NamedTuple):
  """One run of a tree with a CLT spliced in, per layer (layers first).

  Attributes:
    inputs: each call's input (what layer `l`'s features read), `[layers, ..., d_in]`.
    features: each layer's features, `[layers, ..., width]`.
    outputs: each call's output (the model's own), `[layers, ..., d_out]`.
    reconstructions: each call's output as the CLT rebuilds it (decodes, bias, skip).
    errors: `outputs - reconstructions`, the error term of each call.
  """

  inputs: Any
  features: Any
  outputs: Any
  reconstructions: Any
  errors: Any


def replacement_run(
  tree: CallNode, clt: CrossLayerTranscoder, at: Sequence[Any], args: Any, *, jit: bool = True
) -> Replacement:
  """Each layer's input, features, output, reconstruction and error term in one run of
  `tree` on `args` with `clt` spliced at the calls `at` (as `splice` takes them).

  Example:
    >>> import flaxlens as fl, flaxlens.dictionaries as fld, jax.numpy as jnp
    >>> from flax import nnx
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs))
    >>> x = jnp.ones((2, 4))
    >>> clt = fld.CrossLayerTranscoder(2, 4, 4, 8, rngs=nnx.Rngs(2))
    >>> run = fld.replacement_run(fl.unflaxify(model, x), clt, ["layers/0", "layers/1"], x)
    >>> run.features.shape, bool((run.outputs[1] == model(x)).all())
    ((2, 2, 8), True)
  """
  if not isinstance(clt, CrossLayerTranscoder):
    raise ArgumentError(
      f"fld.replacement_run: clt= is a {type(clt).__name__}, not an"
      " fld.CrossLayerTranscoder. Give the CLT (a transcoder is a CLT of one layer)."
    )
  spliced = splice(tree, clt, at)
  names = [site.name for site in (_one_site(tree, a, sites_of(tree), "at")[0] for a in at)]
  _, cache = capture(spliced, args, [*names, *(f"{n}/clt" for n in names)], inputs=True, jit=jit)
  inputs = jnp.stack([cache[f"{n}:input"] for n in names])
  features = jnp.stack([cache[f"{n}/clt"] for n in names])
  outputs = jnp.stack([cache[n] for n in names])
  reconstructions = clt.decode(features)
  skipped = clt.skip_of(inputs)
  reconstructions = reconstructions if skipped is None else reconstructions + skipped
  return Replacement(inputs, features, outputs, reconstructions, outputs - reconstructions)
