"""Sites: the calls of a tree that tools address, how they are named, and how a site
pattern (a path glob, a module class, a call node, a predicate, or a list of these)
resolves to them; the `part=` and `on=` checks a site's recorded signature allows. No Flax
internals here."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from flaxlens.core._edit import EditedCall
from flaxlens.core._node import CallNode
from flaxlens.core._selectors import path_matches
from flaxlens.core._walk import Relation, calls
from flaxlens.errors import (
  ArgumentError,
  SelectionError,
)
from flaxlens.tools.base._parts import one_array
from flaxlens.tools.base._site_objects import NestsTree, SiteObject

# --- sites --------------------------------------------------------------------------------


class Site(NamedTuple):
  """One call of a tree that can be probed.

  Attributes:
    name: how results name it: the module path (`"Block_0/Dense_0"`), with
      `.method` for methods other than `__call__`, `#k` for the k-th further call of the
      same module and method; the root (and a module applied on its own inside the
      model, whose path is empty) by its class and method.
    node: the call node.
    output: `(treedef, leaf summaries)` of the output conversion saw, or None.
    inputs: `(treedef, leaf summaries)` of `(args, kwargs)` conversion saw, or None.
    nested: whether the call is one of a tree nested in a replaced call (a spliced
      module): path patterns match it by its name only, not its module's own path.
  """

  name: str
  node: CallNode
  output: Any
  inputs: Any
  nested: bool = False


def sites_of(root: CallNode) -> list[Site]:
  """Every call a run of `root` makes through its own nodes, in call order.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> from flaxlens.extend import sites_of
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> [site.name for site in sites_of(tree)]
    ['Sequential.__call__', 'layers_0', 'layers_2']
  """
  return _sites(root, None, {})


def _sites(root: CallNode, prefix: str | None, seen: dict[str, int]) -> list[Site]:
  """`sites_of(root)`; with `prefix`, the sites of a tree nested in a replaced call (a
  spliced module), named under it: `prefix` for its root, `prefix.method` for its other
  methods, `prefix/path` for its submodules."""
  sites: list[Site] = []
  replaced: dict[tuple[int, Any], tuple[Any, str]] = {}
  for call in calls(root):
    node, spec = call.layer, call.spec
    if call.relation is Relation.REPLACED:  # named as conversion saw it, until continued
      path = "/".join(map(str, spec.path)) if spec is not None else call.key[1]
      method = spec.method_name if spec is not None else "__call__"
      where = path if method == "__call__" else f"{path}.{method}"
      replaced[id(call.parent), call.key] = (node, where)
      continue
    if call.relation is Relation.NESTED:
      layer, outer = replaced[id(call.parent), call.key]
      sites += _sites(node, f"{outer}/{_nested_name(layer, node)}", seen)
      continue
    path, method = node.readable_path()
    if prefix is not None:
      name = prefix + (f"/{path}" if path and node is not root else "")
      name += "" if method == "__call__" else f".{method}"
    elif node is root or not path:  # The root, or a module applied on its own inside.
      name = f"{node.module_type.__name__}.{method}"
    else:
      name = path if method == "__call__" else f"{path}.{method}"
    count = seen.get(name, 0)
    seen[name] = count + 1
    if count:
      name = f"{name}#{count}"
    if call.relation is Relation.CONTINUED:  # trees nested in its replacement go under it
      replaced[id(call.parent), call.key] = (replaced[id(call.parent), call.key][0], name)
    output = spec.output if spec is not None else None
    inputs = spec.inputs if spec is not None else None
    sites.append(Site(name, node, output, inputs, prefix is not None))
  return sites


def _nested_name(layer: Any, node: CallNode) -> str:
  """How the sites of a tree nested in a replacement are named under the replaced call:
  the name of the edit holding it (`fl.splice`'s `name=`), else its module's class."""
  for edit in layer.edits if isinstance(layer, EditedCall) else ():
    if isinstance(edit, NestsTree) and edit.module is node:
      return edit.name
  return node.module_type.__name__


@dataclasses.dataclass(frozen=True)
class Called:
  """A site given as a call node, named by its site name: `fl.run` compiles the tree as a
  pytree, so inside the compiled run the node is another object than the one given."""

  name: str


_ITERATION = re.compile(r"(.+)\[(\d+(?:,\d+)*)\]")


def iteration_suffix(
  at: Any, sites: Sequence[Site], root: CallNode
) -> tuple[str, tuple[int, ...]] | None:
  """`(pattern, iteration)` where `at` is a path pattern with an iteration suffix that
  names one iteration of the scans around its calls (`"layers[2]"`, `"layers/mlp[1,3]"`
  for two nested scans, as `fl.sweep` names its rows): a string ending in `[` digits
  (comma-separated) `]` whose part before the suffix matches a call. Else None: the
  whole string is a glob as before (`"Block_[0-3]"`, where `Block_` matches no call).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> from flaxlens.tools.base._sites import iteration_suffix, sites_of
    >>> model, x = nn.Sequential([nn.Dense(3), nn.relu, nn.Dense(2)]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> sites = sites_of(tree)
    >>> iteration_suffix("layers_0[2]", sites, tree), iteration_suffix("layers_[02]", sites, tree)
    (('layers_0', (2,)), None)
  """
  found = _ITERATION.fullmatch(at) if isinstance(at, str) else None
  if found is None or not any(_matches(found[1], site, root) for site in sites):
    return None
  return found[1], tuple(int(k) for k in found[2].split(","))


def select_iterations(
  root: CallNode, at: Any, sites: list[Site]
) -> list[tuple[Site, tuple[int, ...] | None]]:
  """The sites `at` names, as `select_sites` gives them, each with the iteration its
  option's suffix names (`"layers[2]"`: `(2,)`), or None for every iteration."""
  options = list(at) if isinstance(at, list | tuple) else [at]
  if not options:  # select_sites refuses an empty list (it names no call): as it says
    return [(site, None) for site in select_sites(root, at, sites)]
  chosen: dict[tuple[int, tuple[int, ...] | None], tuple[Site, tuple[int, ...] | None]] = {}
  for option in options:
    suffix = iteration_suffix(option, sites, root)
    pattern, iteration = suffix if suffix is not None else (option, None)
    for site in select_sites(root, pattern, sites):
      chosen[id(site), iteration] = (site, iteration)
  order = {id(site): k for k, site in enumerate(sites)}
  return sorted(chosen.values(), key=lambda pair: order[id(pair[0])])


def _matches(at: Any, site: Site, root: CallNode) -> bool:
  if isinstance(at, Called):
    return site.name == at.name
  if isinstance(at, str):
    if at in ("all", "**"):
      return True
    path, method = site.node.readable_path()
    return (
      at == site.name
      or path_matches(at, site.name)
      or (
        site.node is not root
        and not site.nested
        and (path_matches(at, path) or path_matches(at, f"{path}.{method}"))
      )
    )
  if isinstance(at, CallNode):
    return site.node is at
  if isinstance(at, type):
    return issubclass(site.node.module_type, at)
  if callable(at):
    return bool(at(site.node))
  if isinstance(at, SiteObject):
    raise SelectionError(
      f"{root.where()}: the site object {at!r} resolves itself, and this takes site"
      " patterns only (a path pattern, a module class, a call node or a predicate). Give"
      " the pattern of the calls it names, or use it with fl.run, fl.capture, fl.sweep or"
      " fl.path_patch."
    )
  raise ArgumentError(
    f"A site is a path pattern (str), a Flax module class, a CallNode or a predicate"
    f" on call nodes, got {type(at).__name__}."
  )


def select_sites(root: CallNode, at: Any, sites: list[Site] | None = None) -> list[Site]:
  """The sites of `root` that `at` names (a pattern, class, node, predicate or a list), in
  call order.

  Raises:
    SelectionError: if `at`, or one element of a list, matches no call; the message
      lists the closest site names.
  """
  sites = sites_of(root) if sites is None else sites
  options = list(at) if isinstance(at, list | tuple) else [at]
  if not options:
    raise SelectionError(f"An empty list of sites selects no call of {root.where()}.")
  chosen: set[int] = set()
  for option in options:
    suffix = iteration_suffix(option, sites, root)
    if suffix is not None:
      raise SelectionError(
        f"The site {option!r} names iteration {list(suffix[1])} of the scans around"
        f" {suffix[0]!r}, and this takes whole calls (every iteration). Give {suffix[0]!r};"
        " one iteration is addressed in fl.run, fl.capture and the interventions"
        " (fl.ablate, fl.patch, fl.steer, fl.scale, fl.modify) they run."
      )
    matched = [id(s) for s in sites if _matches(option, s, root)]
    if not matched:
      raise SelectionError(no_match(root, option, sites))
    chosen.update(matched)
  return [s for s in sites if id(s) in chosen]


def no_match(root: CallNode, at: Any, sites: list[Site]) -> str:
  names = [s.name for s in sites]
  listed = f"{names[:12]}{' ...' if len(names) > 12 else ''}"
  where = root.where()
  if isinstance(at, str):
    close = difflib.get_close_matches(at, names, n=5, cutoff=0.3)
    return (
      f"No call of {where} matches the site {at!r}."
      + (f" Closest: {close}." if close else f" Its calls: {listed}.")
      + " Give a call's name or a glob over names ('**/Dense_0', 'Block_*')."
    )
  if isinstance(at, type):
    classes = sorted({s.node.module_type.__name__ for s in sites})
    return (
      f"No call of {where} is a call of a {at.__qualname__} (or a subclass); it calls"
      f" {classes}. Give one of these classes, or a path pattern."
    )
  if isinstance(at, CallNode):
    return (
      f"The call node {at.where()} is not a call of {where}. Give a node of this tree"
      " (tree.select().at_path(...).get()) or its path pattern."
    )
  return (
    f"The predicate {getattr(at, '__qualname__', at)!r} matches no call of {where}; its"
    f" calls: {listed}. Check the predicate, or give a path pattern."
  )


def every_call(at: Any) -> bool:
  """Whether a site is every call (what the run calls, then, not what conversion saw)."""
  return at is True or (isinstance(at, str) and at in ("all", "**"))


def check_part(site: Site, part: Any, on: str, at: Any = None, sites: Sequence[Site] = ()) -> Any:
  """The array `part` picks from the `on` ("output" or "input") of `site` as conversion
  saw it (a `jax.ShapeDtypeStruct`), or None where conversion did not see it; refused,
  before anything runs, where that is not one array (the `part=` rule, `_parts.py`).
  Where `at`, the site pattern that chose the call, names a module path without a method
  and so every method of that module that ran (`sites`), the refusal says so and gives
  the pattern that names one method."""
  signature = site.output if on == "output" else site.inputs
  if signature is None:
    return None
  value = jax.tree_util.tree_unflatten(*signature)
  if on == "input":
    args = value[0]
    if not args:
      raise ArgumentError(
        f"{site.name}: on='input' is the first positional argument, and this call takes"
        " none (only keyword arguments). Use the output of the call that computes its"
        " argument instead."
      )
    value = args[0]
  try:
    return one_array(value, part, site.name, on)
  except ArgumentError as e:
    note = several_methods(at, site, sites)
    if not note:
      raise
    raise ArgumentError(f"{e} {note}") from None


def several_methods(at: Any, site: Site, sites: Sequence[Site]) -> str:
  """Where the path pattern `at` names `site`'s module path, without a method, and so
  every method of that module that ran (`attn.__call__` and `attn._split_heads`), a
  sentence saying so and giving the pattern of one method; else "".

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> from flaxlens.tools.base._sites import several_methods, sites_of
    >>> class Twice(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return self.half(x) * 2
    ...   def half(self, x):
    ...     return x / 2
    >>> model, x = nn.Sequential([Twice(), nn.relu]), jnp.ones((1, 4))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> sites = sites_of(tree)
    >>> several_methods("layers_0", sites[1], sites).split("ran: ")[1]
    "['layers_0', 'layers_0.half']. Give 'layers_0.__call__' to name its call alone."
  """
  path, _ = site.node.readable_path()
  if not isinstance(at, str) or every_call(at) or site.nested or not path_matches(at, path):
    return ""
  methods: dict[str, str] = {}  # method: the site name of its first call
  for s in sites:
    if not s.nested and s.node.readable_path()[0] == path:
      methods.setdefault(s.node.readable_path()[1], s.name)
  if len(methods) < 2:
    return ""
  method = "__call__" if "__call__" in methods else next(iter(methods))
  alone = "its call alone" if method == "__call__" else "one method alone"
  return (
    f"The site {at!r} is a module path without a method, so it names every method of that"
    f" module that ran: {list(methods.values())}. Give {at + '.' + method!r} to name"
    f" {alone}."
  )
