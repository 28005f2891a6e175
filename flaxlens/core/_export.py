"""What may be exported: a tree whose edits all live in its variables.

Exporting writes a tree's variables back into its framework's own form (Linen: a
variables dict, NNX: a module), so it can only express what variables express. A call
replaced by a layer, wrapped by one, or replaced by a node of another tree is code, not
weights: `check_exportable` refuses such a tree and lists every replaced call, instead of
exporting variables that would run without the patch. No Flax internals here.
"""

from __future__ import annotations

from flaxlens.core._names import join_name
from flaxlens.core._node import CallNode
from flaxlens.core._walk import Relation, calls
from flaxlens.errors import ExportError


def replaced_calls(root: CallNode) -> list[str]:
  """How messages name each call under `root` that was replaced or wrapped, in call order.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> from flaxlens.core._export import replaced_calls
    >>> model, x = nn.Sequential([nn.Dense(2), nn.Dense(2)]), jnp.ones((1, 2))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> replaced_calls(tree.select().at_path("layers_1").apply(lambda n: fl.ArgsAndKwargs))
    ['layers_1.__call__']
  """
  found: list[str] = []
  for call in calls(root):
    if call.relation is not Relation.REPLACED:
      continue
    spec, node = call.spec, call.parent
    if spec is None:
      found.append(f"{node.where()} call {call.key!r}")
      continue
    method = spec.method_name
    if not isinstance(method, str):
      method = getattr(method, "__name__", type(method).__name__)
    found.append(f"{join_name(spec.path) or node.module_type.__name__}.{method}")
  return found


def check_exportable(root: CallNode) -> None:
  """Refuses to export a tree holding replaced calls, naming every one.

  Raises:
    ExportError: if a call under `root` was replaced or wrapped by a layer (or by a
      node of another tree).
  """
  replaced = replaced_calls(root)
  if replaced:
    raise ExportError(
      f"{root.where()}: the tree has replaced calls (layers in place of calls, placed"
      f" interventions) that its variables cannot express, at {replaced}: an export would"
      " run without them. Export the tree before replacing calls, fold interventions"
      " into weights with fl.fold, or make the change an edit of the variables"
      " (variable.value = ...)."
    )
