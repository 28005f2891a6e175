"""Lenses: read each captured residual stream through the model's own head (logit lens).

`fl.lens` captures the value of chosen calls (each block's output, say) and projects
each one through the model's own final layers: the run is patched at the input of the
head's first call (the final norm) with the captured value, and the output of its last
call (the unembedding) is read. The head is found from the tree (the calls that run
after the last block, on the way to the output) or named by the user; whatever the
model does between those calls (a tied unembedding through `Embed.attend`, a soft cap)
runs as the model runs it, so the last block's lens is the model's own logits. All
projections and the capture are one compiled program: the patched runs differ from
the model's only after the head's input, so XLA drops every block before it. Every run
starts from a copy of the tree's variables, so state a run would update (batch
statistics, NNX random counts) is left as it was, as sweeps leave it. No Flax internals
here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxlens.core._jit import variable_jit
from flaxlens.core._node import CallNode, check_tree
from flaxlens.core._runtime import resolve_random_streams
from flaxlens.core._variables import Scratch
from flaxlens.errors import ArgumentError, SelectionError
from flaxlens.tools.analysis._interventions import patch
from flaxlens.tools.base._calling import model_arguments, takes_model_arguments
from flaxlens.tools.base._index import checked, is_array
from flaxlens.tools.base._index import split as _split_index
from flaxlens.tools.base._parts import checked_part, one_array
from flaxlens.tools.base._probed import run
from flaxlens.tools.base._sites import Site, check_part, select_sites, sites_of


@dataclasses.dataclass(frozen=True)
class LensResult:
  """What `fl.lens` read at each site.

  Attributes:
    sites: the lensed sites' names, in call order.
    logits: the head's output at each site, stacked: `(len(sites), *logits shape)`
      (the positions `index=` kept).
    top_tokens: the `top` largest logits' indices at each site and position,
      `(len(sites), ..., top)`, largest first.
    top_probs: their softmax probabilities, same shape.
    output: the model's own output on the arguments (unpatched).
    head: the names of the head's first and last calls (`("ln_f", "lm_head")`), or
      None for a head given as a function.

  Example:
    >>> import flaxlens as fl, numpy as np
    >>> result = fl.LensResult(("Block_0", "Block_1"), np.zeros((2, 1, 5)),
    ...   np.zeros((2, 1, 3), int), np.zeros((2, 1, 3)), np.zeros((1, 5)), ("ln", "head"))
    >>> result["Block_1"].shape
    (1, 5)
  """

  sites: tuple[str, ...]
  logits: Any
  top_tokens: Any
  top_probs: Any
  output: Any
  head: tuple[str, str] | None

  def __getitem__(self, site: str) -> Any:
    """The logits at `site` (one of `sites`)."""
    if site not in self.sites:
      raise SelectionError(
        f"LensResult: no site {site!r}; its sites are {list(self.sites)}. Index by one of them."
      )
    return self.logits[self.sites.index(site)]


def _inside(site: Site, outer: Site) -> bool:
  """Whether `site` is a call made inside `outer`'s module (by module path)."""
  path, outer_path = tuple(site.node.path), tuple(outer.node.path)
  return len(path) > len(outer_path) and path[: len(outer_path)] == outer_path


def last_block(tree: CallNode, lensed: list[Site], sites: list[Site]) -> Site:
  """The last call like the last lensed one (same class, method and parent module)."""
  last = lensed[-1]
  like = [
    s
    for s in sites
    if s.node is not tree
    and s.node.module_type is last.node.module_type
    and s.node.method_name == last.node.method_name
    and tuple(s.node.path[:-1]) == tuple(last.node.path[:-1])
  ]
  return like[-1] if like else last


def found_head(tree: CallNode, lensed: list[Site], sites: list[Site]) -> tuple[Site, Site]:
  """The head's first and last calls: of the calls made after the last call like the last
  lensed one (same class, method and parent module: the last block) and outside it, the
  first, and the last that no other of them encloses.

  Raises:
    SelectionError: no call runs after the last block.
  """
  anchor = last_block(tree, lensed, sites)
  start = sites.index(anchor) + 1
  after = [s for s in sites[start:] if not _inside(s, anchor)]
  if not after:
    raise SelectionError(
      f"fl.lens: no call of {tree.where()} runs after {anchor.name} on the way to the"
      " output, so its final norm and unembedding cannot be found. Name them:"
      " head=['ln_f', 'lm_head'] (the first and last call of the head, as sites), or pass"
      " a function of the residual returning the logits: head=lambda h: ..."
    )
  outer = [s for i, s in enumerate(after) if not any(_inside(s, o) for o in after[:i])]
  return after[0], outer[-1]


def _named_head(tree: CallNode, head: Sequence[Any], sites: list[Site]) -> tuple[Site, Site]:
  if len(head) not in (1, 2):
    raise ArgumentError(
      f"fl.lens: head= names the head's first and last calls (two sites, or one for a"
      f" single call), got {len(head)}. Pass head=['ln_f', 'lm_head']."
    )
  chosen = []
  for at in head:
    found = select_sites(tree, at, sites)
    if len(found) != 1:
      raise ArgumentError(
        f"fl.lens: head= site {at!r} names {len(found)} calls ({[s.name for s in found][:6]});"
        " each must name one call. Give its full name (as fl.capture keys it)."
      )
    chosen.append(found[0])
  first, last = chosen[0], chosen[-1]
  if sites.index(last) < sites.index(first):
    raise ArgumentError(
      f"fl.lens: head= names {last.name} as the last call, but it runs before {first.name}."
      " Name the head's first call (the final norm) first, then its last (the unembedding)."
    )
  return first, last


def _residual(value: Any, part: Any, site: str) -> Any:
  return one_array(value, part, site, "output")


@takes_model_arguments("fl.lens(tree, fl.ArgsAndKwargs.capture(ids, deterministic=True), 'h/*')")
def lens(
  tree: CallNode,
  args: Any,
  /,
  at: Any,
  *,
  head: Any = None,
  part: Any = None,
  top: int = 5,
  index: Any = None,
  random_streams: Any = None,
  jit: bool = True,
) -> LensResult:
  """Projects the value of each call `at` through the model's own head (a logit lens).

  Each site's output (the residual stream after a block) is fed to the model's head in
  place of the head's own input, and the head's output (the logits) is read. The head
  is found from the tree: of the calls that run after the last block (the last call of
  the lensed call's class, method and parent module), the first (the final norm) is
  where the residual enters, and the last that no other of them encloses (the
  unembedding: a `Dense`/`Linear`, or a tied `Embed.attend`) gives the logits.
  Everything the model does in between runs as the model runs it, so the last block's
  lens equals the model's logits bit for bit. The capture and every projection are one
  compiled program. Every run starts from the tree's state (batch statistics, NNX
  random counts), which the lens leaves unchanged, as `fl.sweep` does.

  Args:
    tree: a converted tree.
    args: the model's arguments (one value, a tuple, or `fl.ArgsAndKwargs`).
    at: the sites to lens (`"Block_*"`, `"transformer/h/*"`), as `fl.capture` takes them.
    head: None (find it), the head's first and last calls as sites
      (`["ln_f", "lm_head"]`; one site for a head of one call), or a function of the
      residual returning the logits.
    part: for sites returning a structured value, which part is the residual
      (`part=0` for Hugging Face blocks, which return tuples; docs/interventions.md,
      "Structured values: part=").
    top: how many top tokens to keep per site and position.
    index: keep `logits[index]` of each site (`jnp.s_[:, -1]`: the last position).
    random_streams: as for a tree call (Linen: `{"dropout": key}`).
    jit: compile the run (default); `jit=False` inside your own transforms, with the
      head named (`head=result.head` of a lens outside them) or given as a function.

  Returns:
    A `LensResult`: the sites, their logits stacked, the top tokens and probabilities,
    the model's output and the head's calls.

  Raises:
    SelectionError: a site matches no call, or no call runs after the last block (name
      the head with `head=`).
    ArgumentError: (a head found from the tree) the last block's lens is not the head's
      own output in the model's run, or does not depend on the residual: name the head.
    ArgumentError: a residual's shape is not the head's input shape, `head=` names
      calls that are not one call each, in order, or is a function that does not return
      one array of logits (vocabulary last), or a head found from the tree is used under
      your own transform, where its check has no values.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return x + nn.Dense(8)(nn.relu(x))
    >>> class LM(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, ids):
    ...     embed = nn.Embed(11, 8)
    ...     x = embed(ids)
    ...     for _ in range(3):
    ...       x = Block()(x)
    ...     return embed.attend(nn.LayerNorm(name="ln_f")(x))
    >>> ids = jnp.arange(6).reshape(1, 6)
    >>> model = LM()
    >>> variables = model.init(jax.random.key(0), ids)
    >>> tree = fl.unflaxify(model, variables, ids)
    >>> result = fl.lens(tree, ids, "Block_*", top=3)
    >>> result.sites, result.head, result.logits.shape, result.top_tokens.shape
    (('Block_0', 'Block_1', 'Block_2'), ('ln_f', 'Embed_0.attend'), (3, 1, 6, 11), (3, 1, 6, 3))
    >>> bool((result["Block_2"] == jax.jit(model.apply)(variables, ids)).all())
    True
  """
  check_tree(tree, "fl.lens")
  if not isinstance(top, int) or isinstance(top, bool) or top < 1:
    raise ArgumentError(f"fl.lens: top= is a positive int (tokens kept per position), got {top!r}.")
  argument = model_arguments(args)
  random_streams = resolve_random_streams(random_streams, tree.where())
  sites = sites_of(tree)
  lensed = select_sites(tree, at, sites)
  part = checked_part(part, "fl.lens")
  for site in lensed:
    check_part(site, part, "output", at, sites)
  if callable(head) and not isinstance(head, str | type | CallNode):
    ends = None
  else:
    first, last = (
      found_head(tree, lensed, sites)
      if head is None
      else _named_head(tree, list(head) if isinstance(head, list | tuple) else [head], sites)
    )
    ends = (first.name, last.name)
    if any(s.name in ends for s in lensed):
      raise ArgumentError(
        f"fl.lens: the lensed sites include the head's call {ends}; lens the blocks"
        " before the head (at='Block_*'), or name the head with head=[...]."
      )
  names = tuple(s.name for s in lensed)
  if index is not None:
    index = _split_index(index if isinstance(index, tuple) else (index,))
  check = last_block(tree, lensed, sites).name if head is None else None
  runner = _lens_compiled if jit else _lens_once
  output, logits, checked_head = runner(
    tree,
    argument,
    names,
    ends,
    head if ends is None else None,
    part,
    index,
    random_streams,
    check,
  )
  if check is not None:
    if any(isinstance(a, jax.core.Tracer) for a in checked_head):
      raise ArgumentError(
        f"fl.lens: the head found from {tree.where()}, from {ends[0]} to {ends[1]}, is"
        " checked against the model's own logits, and under your own jax.jit, vmap or grad"
        " those are traced, without values to compare. Lens once outside the transform,"
        " then pass the head it found and checked, head=result.head (here"
        f" head={list(ends)!r}), or a function of the residual: head=lambda h: ..."
      )
    _check_found_head(ends, check, *checked_head)
    _check_head_gives_output(ends, output, checked_head[0])
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top_probs, top_tokens = jax.lax.top_k(probs, min(top, logits.shape[-1]))
  return LensResult(names, logits, top_tokens, top_probs, output, ends)


def _lens_once(
  tree: CallNode,
  argument: Any,
  names: tuple[str, ...],
  ends: tuple[str, str] | None,
  fn: Callable[[Any], Any] | None,
  part: Any,
  index: Any,
  random_streams: Any,
  check: str | None = None,
) -> tuple[Any, Any, Any]:
  """The model's output, the stacked logits at each of `names` (uncompiled) and, with
  `check` (the last block's name), what `_check_found_head` compares; each run is of a
  fresh copy of the tree, so every run starts from its state and none is kept."""
  captured = list(dict.fromkeys([*names, *((check, ends[1]) if check else ())]))
  scratch = Scratch(tree)
  output, cache = run(
    scratch.copy(),
    argument,
    capture=captured,
    random_streams=random_streams,
    jit=False,
  )

  def project(residual: Any, name: str) -> Any:
    if ends is None:
      return _head_logits(fn, residual, name)
    copy = scratch.copy()
    return _through_head(copy, argument, ends, residual, name, random_streams)

  projected, full = [], {}
  for name in names:
    logits = full[name] = project(_residual(cache[name], part, name), name)
    if index is not None:
      logits = logits[checked(*index, tuple(logits.shape), f"fl.lens: {name}: index=", "logits")]
    projected.append(logits)
  checks = None
  if check is not None:
    residual = _residual(cache[check], part, check)
    own = full[check] if check in full else project(residual, check)
    # a change of every element alike in no row or channel: no norm removes it
    pattern = jnp.cos(1.7 * jnp.arange(residual.size)).reshape(residual.shape)
    shifted = residual + (jnp.abs(residual).max() + 1) * pattern
    checks = (cache[ends[1]], own, project(shifted.astype(residual.dtype), check))
  return output, jnp.stack(projected), checks


def _head_logits(fn: Callable[[Any], Any], residual: Any, name: str) -> Any:
  """`fn(residual)`, the logits of a head given as a function, refused unless it is one
  array with the vocabulary as a last axis after the residual's leading axes (of rank at
  least the residual's), which `top_tokens` ranks along."""
  logits = fn(residual)
  if not is_array(logits) or logits.ndim < max(residual.ndim, 1):
    got = (
      f"an array of shape {tuple(logits.shape)}"
      if is_array(logits)
      else f"a {type(logits).__name__}"
    )
    raise ArgumentError(
      f"fl.lens: the head function returned {got} for the residual at {name}, of shape"
      f" {tuple(residual.shape)}; it must return one array of logits, the residual's"
      f" leading axes then the vocabulary axis last (rank {max(residual.ndim, 1)} or more),"
      " as head=lambda h: ln_f(h) @ unembedding does. Return the logits alone, unreduced."
    )
  return logits


def _within_rounding(reference: Any, value: Any) -> bool:
  """Whether `value` is `reference` (same shape) to a few ulps of `reference`'s dtype,
  scaled by its largest magnitude: what two compiled programs computing the same logits
  may differ by."""
  dtype = reference.dtype
  eps = float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.inexact) else 0.0
  reference, value = (np.asarray(jax.device_get(a), np.float64) for a in (reference, value))
  if reference.shape != value.shape:
    return False
  rounding = 16 * eps * (float(np.abs(reference).max(initial=0.0)) + 1.0)
  return bool(np.abs(value - reference).max(initial=0.0) <= rounding)


def _check_found_head(ends: tuple[str, str], block: str, model: Any, own: Any, other: Any) -> None:
  """Refuses a head found from the tree that does not give the model's own logits for
  its last block, or that does not read the residual at all.

  Raises:
    ArgumentError: the last block's lens is not (to rounding) the head's last call's
      output in the model's own run, or a different residual gives the same logits.
  """
  first, last = ends
  reproduces = _within_rounding(model, own)
  own, other = (np.asarray(jax.device_get(a), np.float64) for a in (own, other))
  fix = (
    " Name the head's first and last calls yourself, head=['ln_f', 'lm_head'] (the call"
    " the residual enters and the call returning the logits), or pass a function of the"
    " residual: head=lambda h: ..."
  )
  if not reproduces:
    raise ArgumentError(
      f"fl.lens: the head found from the tree, from {first} to {last}, does not reproduce"
      f" the model's own {last} output for the last block {block}: patching {block}'s"
      f" output in as {first}'s input changes the logits, so {first}'s input is not"
      f" {block}'s output (something runs between them, or {block} is not a block whose"
      " output is the residual stream). Lens the blocks (at='Block_*')." + fix
    )
  if (other == own).all():
    raise ArgumentError(
      f"fl.lens: the head found from the tree, from {first} to {last}, does not read the"
      f" residual: a different value at {first}'s input gives the same {last} output, so"
      f" {first} is not where the residual enters the head (an auxiliary call, such as a"
      " value head, runs after the last block)." + fix
    )


def _check_head_gives_output(ends: tuple[str, str], output: Any, logits: Any) -> None:
  """Refuses a head found from the tree whose last call's output is not the model's: the
  model's output holds arrays shaped like the logits, and none is the head's last call's
  output (the model computes more after it, such as a final soft cap), so the lens would
  not give the model's logits for the last block. A model whose output holds no array of
  that shape (a loss, a pooled value) is not compared.

  Raises:
    ArgumentError: naming the calls found and the ways to choose the head.
  """
  first, last = ends
  shape, dtype = tuple(logits.shape), logits.dtype
  alike = [
    leaf
    for leaf in jax.tree_util.tree_leaves(output)
    if is_array(leaf) and tuple(leaf.shape) == shape and leaf.dtype == dtype
  ]
  if not alike or any(_within_rounding(logits, leaf) for leaf in alike):
    return
  raise ArgumentError(
    f"fl.lens: the head found from the tree ends at {last}, whose output is not the"
    f" model's output: the model computes more after {last} (a final soft cap, a scale,"
    f" a bias), so each lens would be {last}'s output, not the model's logits. Give the"
    " head as a function that ends as the model does (head=lambda h: ..., e.g. the soft"
    f" cap applied to lm_head's output), or name the head head=[{first!r}, {last!r}] to"
    f" lens {last}'s output."
  )


def _through_head(
  tree: CallNode,
  argument: Any,
  ends: tuple[str, str],
  residual: Any,
  name: str,
  random_streams: Any,
) -> Any:
  """The head's output with `residual` as the head's input: the run patched there."""
  first, last = ends
  try:
    _, cache = run(
      tree,
      argument,
      interventions=[patch(first, residual, on="input")],
      capture=last,
      random_streams=random_streams,
      jit=False,
    )
  except ArgumentError as e:
    raise ArgumentError(
      f"fl.lens: the residual at {name} (shape {tuple(residual.shape)}) cannot enter the"
      f" head at {first}: {e} Lens sites whose output is the head's input (the blocks'"
      " outputs), or name the head with head=[...]."
    ) from e
  logits = cache[last]
  if not is_array(logits):
    raise ArgumentError(
      f"fl.lens: the head's last call {last} returns a {type(logits).__name__}, not the"
      " logits array. Name the head's calls: head=['ln_f', 'lm_head']."
    )
  return logits


_lens_compiled = variable_jit(_lens_once)
