"""Changing the static attributes of an NNX tree, as NNX's `train`, `eval`, `view` do.

The tree is immutable: NNX makes the change on a template of the root's module, and every
node of the tree gets the `GraphDef` of its module in the changed template. No Flax
internals here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from flaxlens.core._names import Path
from flaxlens.core._node import CallNode, is_call_node
from flaxlens.core._runtime import Gathered
from flaxlens.nnx._definition import apply_static_edits, navigate, static_edits


def restatic(root: CallNode, change: Callable[[Any], Any]) -> CallNode:
  """`root` with every node's `GraphDef` as NNX's `change(module)` leaves it."""
  root.check_runs_alone("change its attributes on its own; change those of the tree it belongs to")
  Gathered(root)  # Checks that every node belongs under the root.
  definition = root.definition
  model = nnx.merge(definition.graphdef, [None] * len(definition.leaf_paths))
  apply_static_edits(model, static_edits(root))
  changed = change(model)
  if isinstance(changed, nnx.Module):
    model = changed
  graphdefs: dict[Path, Any] = {}
  family = object()

  def regraph(node: CallNode) -> CallNode:
    rel = node.path[len(root.path) :]
    if rel not in graphdefs:
      graphdefs[rel] = nnx.graphdef(navigate(model, rel))
    fields = node.attributes_dict()
    fields["definition"] = node.definition.with_graphdef(graphdefs[rel], family)
    fields["submodule_calls"] = {
      key: jax.tree_util.tree_map(
        lambda x: regraph(x) if is_call_node(x) and x.origin == root.origin else x,
        child,
        is_leaf=is_call_node,
      )
      for key, child in node.submodule_calls.items()
    }
    return type(node).from_attributes(**fields)

  return regraph(root)
