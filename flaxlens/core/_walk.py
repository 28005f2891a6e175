"""The one walk over the calls a run of a tree makes: `calls(root)`.

A run of a root node makes the calls of its own nodes: the root, its children of the
same conversion (`origin`), and, inside each replacement layer, the nodes that continue
the replaced call (same conversion, same module path and method as the call conversion
saw). Any other node a replacement holds runs as a tree of its own: a node of another
conversion (a spliced sparse autoencoder) is a `NESTED` call, whose own calls are
`calls(node)`, made inside the replaced call. `calls` yields one `Call` per call, in call order, and
every view of a tree's calls is built on it, so that none can disagree with another:
the nodes whose variables a run gathers (`own_call_nodes`), whether a tree holds
replaced calls (`pristine`, `pristine_tree`, `calls_fixed`), the calls an export refuses
(`core/_export.py: replaced_calls`), and the sites of interventions and captures
(`tools/base/_sites.py: sites_of`). No Flax internals here.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax

from flaxlens.core._cache import Derived
from flaxlens.core._names import CallKey
from flaxlens.core._node import CallNode, is_call_node
from flaxlens.core._readonly import ReadOnlyDict
from flaxlens.core._spec import CallSpec


class Relation(enum.Enum):
  """How a call of a walk relates to the root's conversion."""

  ROOT = "root"  # the root itself
  OWN = "own"  # a node of the same conversion, where conversion put it
  REPLACED = "replaced"  # a call whose entry is a layer or another tree's node
  CONTINUED = "continued"  # a node of this conversion that a replacement continues
  NESTED = "nested"  # the root of another conversion's tree that a replacement holds


class Call(NamedTuple):
  """One call a run of a root makes, as `calls` finds it.

  Attributes:
    layer: what runs the call: its call node (`ROOT`, `OWN`, `CONTINUED`), or the
      replacement (`REPLACED`: a layer, or a node of another tree).
    parent: the node in whose `submodule_calls` the call's entry is (None for the root).
    key: the entry's key there (None for the root).
    spec: what conversion saw of the call (the root's: None; None where conversion did
      not see the key).
    relation: a `Relation`.
  """

  layer: Any
  parent: CallNode | None
  key: CallKey | None
  spec: CallSpec | None
  relation: Relation


def calls(root: CallNode) -> Iterator[Call]:
  """Every call a run of `root` makes through its own nodes and replacements, in call order.

  Depth first: a call, then the calls made inside it. A replaced call comes first as
  `REPLACED`, then each node of the same conversion inside its replacement that
  continues it (`CONTINUED`; where conversion did not see the call, every node of the
  same conversion inside is taken to continue it), each followed by its own calls, and
  the root of each other conversion's tree inside it (`NESTED`; its calls are not
  walked: that tree runs as a tree of its own, `calls(node)`).

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> from flaxlens.core._walk import calls
    >>> model, x = nn.Sequential([nn.Dense(2), nn.Dense(2)]), jnp.ones((1, 2))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> patched = tree.select().at_path("layers_1").apply(lambda n: fl.ArgsAndKwargs)
    >>> [(c.relation.value, c.key) for c in calls(patched)]
    [('root', None), ('own', (0, 'layers_0.__call__')), ('replaced', (1, 'layers_1.__call__'))]
  """
  yield Call(root, None, None, None, Relation.ROOT)
  yield from _inside(root)


def _inside(node: CallNode) -> Iterator[Call]:
  for key, child in node.submodule_calls.items():
    spec = node.call_spec(key)
    if is_call_node(child) and child.origin == node.origin:
      yield Call(child, node, key, spec, Relation.OWN)
      yield from _inside(child)
      continue
    yield Call(child, node, key, spec, Relation.REPLACED)
    for leaf in jax.tree_util.tree_leaves(child, is_leaf=is_call_node):
      if is_call_node(leaf) and leaf.origin == node.origin:
        if spec is None or spec.continued_by(leaf):
          yield Call(leaf, node, key, spec, Relation.CONTINUED)
          yield from _inside(leaf)
      elif is_call_node(leaf) and leaf.origin != node.origin:
        yield Call(leaf, node, key, None, Relation.NESTED)


def own_call_nodes(root: CallNode) -> Iterator[CallNode]:
  """The nodes whose variables a run of `root` uses, parents first (the calls it makes
  through its own nodes: every call of `calls` but the replacements and nested trees)."""
  for call in calls(root):
    if call.relation not in (Relation.REPLACED, Relation.NESTED):
      yield call.layer


def pristine(node: CallNode) -> bool:
  """Whether no call under `node` has been replaced (by a layer or another tree's node)."""
  return all(call.relation is not Relation.REPLACED for call in calls(node))


class _Structure(NamedTuple):
  pristine: bool  # no call replaced
  fixed: bool  # every `submodule_calls` the answer depends on is read-only


def _structure(root: CallNode) -> _Structure:
  fixed = True
  for call in calls(root):
    if call.relation is Relation.REPLACED:
      return _Structure(False, fixed)
    fixed = fixed and isinstance(call.layer.submodule_calls, ReadOnlyDict)
  return _Structure(True, fixed)


# Kept where it cannot change: the calls of a converted tree are fixed once it is made
# (every `submodule_calls` is read-only); a hand-built node holding a plain dict on the
# way is walked again at every use.
_STRUCTURE = Derived("pristine", _structure, lambda root, s: s.fixed)


def pristine_tree(root: CallNode) -> bool:
  """`pristine(root)`, kept on the node where it cannot change."""
  return _STRUCTURE(root).pristine


def calls_fixed(root: CallNode) -> bool:
  """Whether the calls a run of `root` makes can never change: no call is replaced and
  every `submodule_calls` below `root` is read-only (a converted, unpatched tree)."""
  structure = _STRUCTURE(root)
  return structure.pristine and structure.fixed
