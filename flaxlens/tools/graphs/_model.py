"""The replacement model of a converted tree (`ReplacementModel`): which calls are its
MLPs (where transcoders stand), its token embedding, its normalisations and attentions
(frozen), and the frozen forward that attribution graphs differentiate.

The frozen forward (`frozen_reads`) runs the tree with edits placed:
- the token embedding's output gets a delta (the tokens' write site);
- each MLP's output becomes `stop_gradient(out) + skip(x) - stop_gradient(skip(x)) + delta`:
  the model's own value, only the transcoder's skip carrying gradient across it, and a
  delta (the features' and errors' write site);
- each normalisation and attention is `Frozen` (`_freeze.py`);
and returns what targets read: each MLP's input and the logits at the last position.
With these it is affine in the deltas; its vector-Jacobian products are graph rows.
No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from flaxlens._compat.jaxprs import nonlinear_on_gradient_path
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._node import CallNode
from flaxlens.core._struct import Struct, static_field
from flaxlens.core._walk import own_call_nodes
from flaxlens.errors import ArgumentError, UnsupportedFlaxFeatureError
from flaxlens.tools.base._parts import one_array
from flaxlens.tools.base._probed import placed, run
from flaxlens.tools.base._sites import Called, Site, select_sites, sites_of
from flaxlens.tools.graphs._freeze import ATTENTION, NORM, CallShape, call_shape, frozen_edit

NORM_CLASSES = (nn.LayerNorm, nn.RMSNorm, nnx.LayerNorm, nnx.RMSNorm)
ATTENTION_CLASSES = (nn.MultiHeadDotProductAttention, nnx.MultiHeadAttention)
EMBED_CLASSES = (nn.Embed, nnx.Embed)
# Third-party modules are known by their class names: `FlaxLlamaRMSNorm`, gemma's `RMSNorm`,
# `FlaxGPT2Attention`, gemma's `Attention`, `FlaxLlamaAttention`, `Embedder`.
_NORM_NAME = re.compile(r"(RMS|Layer)Norm")
_ATTENTION_NAME = re.compile(r"Attention$")
_EMBED_NAME = re.compile(r"Embed(der|ding)?$")


class Freeze(NamedTuple):
  """Which calls the replacement model freezes, where they are not found on their own.

  Attributes:
    norms: site patterns of the normalisations whose scale is frozen (None: every call of
      a Flax `LayerNorm`/`RMSNorm`, Linen or NNX, or of a class named `...RMSNorm`/
      `...LayerNorm`).
    attention: site patterns of the attention calls whose pattern is frozen (None: every
      call of a Flax attention module or of a class named `...Attention`).

  Example:
    >>> import flaxlens.graphs as flg
    >>> flg.Freeze(norms=["**/ln_*"], attention=["**/attn"]).norms
    ['**/ln_*']
  """

  norms: Sequence[Any] | None = None
  attention: Sequence[Any] | None = None


def _is(site: Site, classes: tuple[type, ...], name: re.Pattern) -> bool:
  module_type = site.node.module_type
  return isinstance(module_type, type) and (
    issubclass(module_type, classes) or name.search(module_type.__name__) is not None
  )


def _outermost(found: list[Site]) -> list[Site]:
  nested = {id(n) for s in found for n in list(own_call_nodes(s.node))[1:]}
  return [s for s in found if id(s.node) not in nested]


def _inside(site: Site, containers: list[Site]) -> bool:
  return any(
    site.node is not c.node and any(n is site.node for n in own_call_nodes(c.node))
    for c in containers
  )


class Calls(NamedTuple):
  """The calls of a tree the replacement model edits, by site name.

  Attributes:
    mlps: the MLP calls, in layer order (where transcoders stand).
    embed: the token embedding call.
    norms: the normalisation calls frozen.
    attention: the attention calls frozen.
  """

  mlps: tuple[str, ...]
  embed: str
  norms: tuple[str, ...]
  attention: tuple[str, ...]


def found_calls(
  tree: CallNode, at: Sequence[Any], embed: Any, freeze: Freeze | None, where: str
) -> Calls:
  """The `Calls` of `tree`: `at` (one call each), the embedding (`embed=` or found), and
  the norms and attentions (`freeze=` or found), outside the MLPs."""
  sites = sites_of(tree)
  mlps = []
  for layer, pattern in enumerate(at):
    chosen = select_sites(tree, pattern, sites)
    if len(chosen) != 1:
      mlp_like = [s.name for s in sites if re.search(r"mlp|MLP|ffn|FeedForward", s.name)]
      raise ArgumentError(
        f"{where}: at[{layer}]={pattern!r} names {len(chosen)} calls of {tree.where()}"
        f" ({[s.name for s in chosen][:6]}); a transcoder stands in for one MLP call. Give"
        f" the MLP of each layer, in order (calls that look like MLPs: {mlp_like[:12]})."
      )
    if chosen[0].node.sliced:
      raise UnsupportedFlaxFeatureError(
        f"{where}: at[{layer}]={pattern!r} is a call inside a scanned body"
        f" ({chosen[0].name}: nn.scan/nnx.scan over layers), one call for every layer; a"
        " transcoder stands in for one layer's MLP. Convert an unrolled copy of the model."
      )
    mlps.append(chosen[0])
  names = [s.name for s in mlps]
  if len(set(names)) != len(names):
    raise ArgumentError(f"{where}: at= names a call twice ({names}). Give each layer's MLP once.")
  outside = [s for s in sites if s.node is not tree and not _inside(s, mlps) and s not in mlps]
  return Calls(
    mlps=tuple(names),
    embed=_embed(tree, embed, sites, where),
    norms=_chosen(tree, freeze and freeze.norms, outside, NORM_CLASSES, _NORM_NAME, where, "norms"),
    attention=_chosen(
      tree,
      freeze and freeze.attention,
      outside,
      ATTENTION_CLASSES,
      _ATTENTION_NAME,
      where,
      "attention",
    ),
  )


def _chosen(tree, patterns, outside, classes, name, where, what) -> tuple[str, ...]:
  if patterns is None:
    return tuple(s.name for s in _outermost([s for s in outside if _is(s, classes, name)]))
  chosen: list[str] = []
  for pattern in patterns:
    found = select_sites(tree, pattern, outside)  # refuses a pattern matching none
    chosen.extend(s.name for s in found if s.name not in chosen)
  return tuple(chosen)


def _embed(tree: CallNode, embed: Any, sites: list[Site], where: str) -> str:
  if embed is not None:
    found = select_sites(tree, embed, sites)
    if len(found) != 1:
      raise ArgumentError(
        f"{where}: embed={embed!r} names {len(found)} calls of {tree.where()}. Name the one"
        " call that embeds the token ids."
      )
    return found[0].name
  found = [s for s in sites if _is(s, EMBED_CLASSES, _EMBED_NAME)]
  if not found:
    raise ArgumentError(
      f"{where}: found no token embedding in {tree.where()} (no call of nn.Embed, nnx.Embed"
      " or a class named ...Embed/Embedder/Embedding). Name it: embed='path/to/embedding'."
    )
  return found[0].name


class Plan(Struct):
  """What the frozen forward needs beyond arrays (hashable: compiled runs are keyed on
  it): the calls, the shapes of the frozen calls' arguments, and how to read logits.

  Attributes:
    calls: the `Calls`.
    shapes: `{site: CallShape}` of each frozen call's argument.
    logits_of: a function of the model's output giving logits `[1, positions, vocabulary]`,
      or None where the output is that array.
  """

  calls: Calls = static_field()
  shapes: tuple[tuple[str, CallShape], ...] = static_field()
  logits_of: Callable[[Any], Any] | None = static_field(default=None)


class _Delta(Struct):
  """Adds `delta` to a call's output (the token embedding: the tokens' write site)."""

  delta: Any
  at: Any = static_field()
  on: str = static_field(default="output")
  part: Any = static_field(default=None)

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    del argument
    return value + self.delta.astype(value.dtype).reshape(value.shape)


class _Replaced(Struct):
  """An MLP's output in the replacement model: its value, the skip's gradient, a delta."""

  delta: Any
  skip: Any
  at: Any = static_field()
  on: str = static_field(default="output")
  part: Any = static_field(default=None)

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    stop = jax.lax.stop_gradient
    out = stop(value) + self.delta.astype(value.dtype).reshape(value.shape)
    if self.skip is None:
      return out
    x = one_array(argument.args[0], None, site, "input")
    skipped = (x @ self.skip).astype(value.dtype)
    return out + (skipped - stop(skipped))


class _Shapes(Struct):
  """Records the `CallShape` of a call's argument during an abstract run."""

  records = False
  at: Any = static_field()
  found: dict = static_field()
  on: str = static_field(default="output")
  part: Any = static_field(default=None)

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    self.found[site] = call_shape(argument)
    return value


def _declared_part(site: Site) -> Any:
  """The `part=` an edit of the whole output of `site` declares (a frozen call, a shape
  record): None where conversion saw one array, else the first entry of a tuple or
  mapping that is one (a Hugging Face module returns `(hidden_states, ...)`). The edit
  reads and keeps the whole output; the part is what placement checks is an array."""
  if site.output is None:
    return None
  value = jax.tree_util.tree_unflatten(*site.output)
  if isinstance(value, tuple | list):
    entries = list(enumerate(value))
  elif isinstance(value, Mapping):
    entries = list(value.items())
  else:
    return None
  return next((key for key, entry in entries if isinstance(entry, jax.ShapeDtypeStruct)), None)


def frozen_shapes(tree: CallNode, args: Any, calls: Calls) -> tuple[tuple[str, CallShape], ...]:
  """The `CallShape` of each norm and attention call's argument on `args` (an abstract
  run: nothing is computed)."""
  found: dict[str, CallShape] = {}
  names = (*calls.norms, *calls.attention)
  sites = {s.name: s for s in sites_of(tree)}
  edits = tuple(_Shapes(at=Called(n), found=found, part=_declared_part(sites[n])) for n in names)
  marked = placed(tree, edits, "flg.attribute")
  jax.eval_shape(lambda: run(marked, args, jit=False))
  return tuple((n, found[n]) for n in names if n in found)


def frozen_reads(
  tree: CallNode,
  args: Any,
  plan: Plan,
  skips: Any,
  deltas: tuple[Any, Any],
  scores: tuple[str, list] | None = None,
  per_layer: bool = False,
) -> tuple[Any, Any]:
  """The frozen forward: `(inputs, logits)`, each MLP's input `[layers, positions,
  d_in]` and the logits at the last position `[vocabulary]`, as functions of `deltas`
  (`[positions, d_model]` at the embedding, `[layers, positions, d_out]` at the MLPs).
  `skips` holds each layer's `W_skip` (`[d_in, d_out]`) or None. With `scores=(call,
  found)`, that attention call's scores (its softmax's exponent) are appended to `found`.
  With `per_layer`, the inputs are a tuple of each layer's `[positions, d_in]`: a
  transpose that reads some of them skips the layers above (a stacked array's would
  compute them with zeros)."""
  calls = plan.calls
  embed_delta, mlp_deltas = deltas
  shapes = dict(plan.shapes)
  sites = {s.name: s for s in sites_of(tree)}
  edits: list[Any] = [_Delta(delta=embed_delta, at=Called(calls.embed))]
  for layer, name in enumerate(calls.mlps):
    skip = None if skips is None else skips[layer]
    edits.append(_Replaced(delta=mlp_deltas[layer], skip=skip, at=Called(name)))
  for names, freeze, what in (
    (calls.norms, NORM, "normalisation"),
    (calls.attention, ATTENTION, "attention"),
  ):
    for name in names:
      if name not in shapes:
        continue  # a call the run does not make on these arguments
      found = scores[1] if scores is not None and scores[0] == name else None
      edit = frozen_edit(
        sites[name].node, name, Called(name), shapes[name], freeze, what, _FIX, found
      )
      edits.append(dataclasses.replace(edit, part=_declared_part(sites[name])))
  output, cache = run(
    placed(tree, tuple(edits), "flg.attribute"),
    args,
    capture=list(calls.mlps),
    inputs=True,
    jit=False,
  )
  inputs = [one_array(cache[f"{n}:input"], None, n, "input") for n in calls.mlps]
  inputs = [x.reshape(-1, x.shape[-1]) for x in inputs]
  logits = output if plan.logits_of is None else plan.logits_of(output)
  last = logits.reshape(-1, logits.shape[-1])[-1]
  return (tuple(inputs) if per_layer else jnp.stack(inputs)), last


def check_affine(tree: CallNode, args: Any, plan: Plan, skips: Any, zeros: Any, where: str) -> None:
  """Refuses a replacement model whose frozen forward is not affine in the writes: a
  non-linear computation left on the gradient path (an attention or a normalisation that
  was not found and frozen, a logit soft-cap); traced, not run."""
  closed = jax.make_jaxpr(lambda d: frozen_reads(tree, args, plan, skips, d))(zeros)
  found = nonlinear_on_gradient_path(closed.jaxpr, [True] * len(closed.jaxpr.invars))
  if found:
    calls = plan.calls
    raise UnsupportedFlaxFeatureError(
      f"{where}: the replacement model of {tree.where()} is not linear in the nodes' writes:"
      f" {sorted(set(found))} stay on the gradient path, so its edges would not be direct"
      " effects. An attention or a normalisation was not found and frozen (found: norms"
      f" {list(calls.norms)}, attention {list(calls.attention)}), or the logits are read"
      " through a non-linear map (a soft-cap). Name the calls to freeze with"
      " freeze=flg.Freeze(norms=[...], attention=[...]), or give logits= that reads them"
      " before the non-linear map."
    )


_FIX = (
  "Name the calls to freeze with freeze=flg.Freeze(norms=[...], attention=[...]) (an"
  " attention computed by a fused kernel has no pattern to freeze: use the XLA softmax"
  " path of the model)."
)
