"""Attention patterns as a capture site (`fl.attention_pattern`): the softmax weights
`(batch..., heads, q, k)` that a Flax attention module sows with `sow_weights=True`.

A `SiteObject` that can only be captured: its edits stash the query and key the module
computes (after `query_ln`/`key_ln` where it normalises them) and, after the module's
call, compute the weights with the Flax API's own function from them and the `mask` (and,
NNX, `is_causal`) the call was given, through the node's adapter
(`FrameworkAdapter.attention_weights`). No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

from flaxlens.core._adapter import adapter_of
from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._edit import Edit
from flaxlens.core._node import CallNode
from flaxlens.core._probes import active_probing
from flaxlens.core._struct import Struct, static_field
from flaxlens.errors import HeadsError
from flaxlens.tools.analysis._head_settings import call_making, child_call, value_spec
from flaxlens.tools.analysis._heads import (
  attention_class,
  checked_heads,
  checked_which,
  outermost,
  static_site,
)
from flaxlens.tools.base._sites import Site, select_sites


class _Stash(Struct):
  """Records a call's output under `key` for the pattern edit of its module to take."""

  records = True
  part = None
  key: str = static_field()
  on: str = static_field(default="output")

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    del site, argument
    probing = active_probing()
    if probing is not None:
      probing.record(self.key, value)
    return value


class PatternCapture(Struct):
  """Records an attention module's softmax weights, `(batch..., heads, q, k)`, as Flax's
  own `dot_product_attention_weights` computes them from the module's query and key
  (stashed by `_Stash` edits of its calls) and the mask it was given."""

  records = True
  query: str = static_field()
  key: str = static_field()
  name: str = static_field()
  heads: tuple[int, ...] = static_field()
  count: int = static_field()
  module_type: type = static_field()
  adapter: Any = static_field()
  settings: tuple[tuple[str, Any], ...] = static_field()
  shape: Any = static_field(default=None)
  on: str = static_field(default="output")
  part = None

  def edit(self, site: str, argument: ArgsAndKwargs, value: Any) -> Any:
    probing = active_probing()
    if probing is None:
      return value
    stashed = probing.channels[-1].values
    if self.query not in stashed or self.key not in stashed:
      return value  # a trace Flax makes of a body only to learn its shapes
    query, key = stashed.pop(self.query), stashed.pop(self.key)
    weights = _weights(self, query, key, argument, site)
    if len(self.heads) < self.count:
      weights = weights[..., list(self.heads), :, :]
    probing.record(f"{self.name}:pattern", weights, self.shape)
    return value


def _weights(capture: PatternCapture, query: Any, key: Any, argument: Any, site: str) -> Any:
  """Flax's own attention weights of one call, from its query, key and arguments."""
  signature = inspect.signature(capture.module_type.__call__)
  given = dict(signature.bind(None, *argument.args, **argument.kwargs).arguments)
  if given.get("decode"):
    raise HeadsError(
      f"{site}: this call decodes (decode=True): its keys come from the cache, which"
      " the pattern would not read. Capture patterns of calls that do not decode."
    )
  return capture.adapter.attention_weights(dict(capture.settings), query, key, given)


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
  """The attention weights of Flax attention modules, as a capture site (made by
  `fl.attention_pattern`); captured as `"<site>:pattern"`. A `SiteObject` that can only
  be captured.

  Attributes:
    at: the site pattern, class or predicate naming attention modules.
    which: the heads kept (None: every head).

  Example:
    >>> import flaxlens as fl
    >>> fl.attention_pattern("**/attn", 3).which
    (3,)
  """

  at: Any
  which: tuple[int, ...] | None = None

  def __repr__(self) -> str:
    return f"fl.attention_pattern({self.at!r})"

  def capture_edits(
    self, tree: CallNode, sites: list[Site], shape: Callable[[str, Any], Any] | None
  ) -> list[tuple[Site, Edit]]:
    """The edits recording each named attention module's weights (`fl.run`)."""
    out = []
    named = select_sites(tree, self.at, sites)
    for site in outermost([s for s in named if attention_class(s) is not None]):
      settings = site.node.settings()
      _check_pattern(site, settings)
      ln = "_ln" if settings.get("normalize_qk") else ""
      found = call_making(sites, site, f"query{ln}")
      query, key = child_call(sites, site, f"query{ln}"), child_call(sites, site, f"key{ln}")
      if found is None or query is None or key is None:
        raise HeadsError(
          f"{site.name}: this attention module made no query{ln}/key{ln} calls the tree can"
          " read (they were replaced or placed), so its pattern cannot be recomputed."
          " Capture the pattern on a tree without them replaced."
        )
      count = value_spec(query, "output").shape[-2]
      heads = checked_heads(self.which, count, site.name)
      kept = tuple((k, settings.get(k)) for k in _PATTERN_SETTINGS)
      q_key, k_key = f"{site.name}:query (pattern)", f"{site.name}:key (pattern)"
      shaped = None if shape is None else functools.partial(shape, f"{site.name}:pattern")
      out.append((query, _Stash(q_key)))
      out.append((key, _Stash(k_key)))
      holder = found[0]
      module_type = site.node.module_type
      flax_class = attention_class(site)
      if holder is not site:  # a subclass's super().__call__: Flax's own signature
        module_type = flax_class
      elif module_type.__call__ is not flax_class.__call__:
        raise HeadsError(
          f"{site.name}: its class {module_type.__name__} overrides __call__, and the tree"
          f" holds no call of {flax_class.__name__}.__call__ inside it, so the mask (and"
          " is_causal) Flax's attention received are not known, nor that it ran. Capture"
          " its weights natively (sow_weights=True), or call the module through Flax's own"
          " __call__."
        )
      adapter = adapter_of(site.node)
      edit = PatternCapture(
        q_key, k_key, site.name, heads, count, module_type, adapter, kept, shaped
      )
      out.append((holder, edit))
    if not out:
      raise HeadsError(
        f"{self!r}: no call it names is a Flax attention module (nn.MultiHeadDotProductAttention,"
        " nnx.MultiHeadAttention). Name attention modules: their patterns are what Flax"
        " sows with sow_weights=True."
      )
    return out


_PATTERN_SETTINGS = ("dtype", "precision", "force_fp32_for_softmax")


def _function_name(fn: Any) -> str:
  """A function's name as a message shows it: `module.name`, a partial's function and
  arguments, or its repr."""
  if isinstance(fn, functools.partial):
    given = [*map(repr, fn.args), *(f"{k}={v!r}" for k, v in fn.keywords.items())]
    return f"functools.partial({', '.join([_function_name(fn.func), *given])})"
  name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
  module = getattr(fn, "__module__", None)
  return f"{module}.{name}" if name and module else name or repr(fn)


def _check_pattern(site: Site, settings: dict[str, Any]) -> None:
  """Refuses a module whose weights are not Flax's `dot_product_attention_weights`."""
  problem = None
  if not adapter_of(site.node).is_own_attention_function(settings.get("attention_fn")):
    problem = f"its attention_fn is {_function_name(settings.get('attention_fn'))}"
  elif settings.get("decode"):
    problem = "it decodes (decode=True), reading keys from its cache"
  elif settings.get("qk_attn_weights_einsum_cls") is not None:
    problem = "it computes q·k with its own einsum (qk_attn_weights_einsum_cls)"
  if problem:
    raise HeadsError(
      f"{site.name}: {problem}, so its pattern is not Flax's dot_product_attention_weights"
      " of its query and key. Capture the values your attention function computes"
      " (fl.capture of its inputs), or use Flax's own dot_product_attention."
    )


def attention_pattern(at: Any, which: Any = None) -> AttentionPattern:
  """Names the attention weights of Flax attention modules as a capture site.

  `fl.capture(tree, x, at=fl.attention_pattern("block_*/attn"))` returns each module's
  softmax weights as `"<site>:pattern"`, of shape `(batch..., heads, q_length,
  kv_length)`: what the module sows with `sow_weights=True` (before dropout), computed
  by Flax's own `dot_product_attention_weights` from the query and key the module made
  in this run (after `query_ln`/`key_ln` when it normalises them) and the `mask` (and,
  NNX, `is_causal`) it was called with. Interventions earlier in the run change it as
  they change the module's query and key.

  Args:
    at: the attention modules: a path pattern, a module class or a predicate; calls it
      names that are not Flax attention modules are passed over.
    which: a head number or list of them to keep; None: every head.

  Returns:
    An `AttentionPattern` site for `fl.capture`/`fl.run(capture=...)`.

  Raises:
    HeadsError: (when the run is traced) the site names no Flax attention module, or
      one whose weights Flax's function does not compute (a custom `attention_fn`,
      `decode=True`, a custom q·k einsum).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> attn, x = nn.MultiHeadDotProductAttention(num_heads=4), jnp.ones((1, 3, 8))
    >>> tree = fl.unflaxify(attn, attn.init(jax.random.key(0), x), x)
    >>> _, cache = fl.capture(tree, x, at=fl.attention_pattern(nn.MultiHeadDotProductAttention))
    >>> cache["MultiHeadDotProductAttention.__call__:pattern"].shape
    (1, 4, 3, 3)
  """
  return AttentionPattern(static_site(at), checked_which(which, f"fl.attention_pattern({at!r})"))
