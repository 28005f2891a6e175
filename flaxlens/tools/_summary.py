"""A readable outline of a converted tree: one line per call, with its variable counts.

`summary(tree)` returns a `rich.tree.Tree`; printing it with rich shows the call
hierarchy as the model ran it, each call with its key, module class and how many
parameters and state values the call's module owns. Replaced calls show their layer
class. No Flax internals here.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from rich.tree import Tree

from flaxlens.core._node import is_call_node
from flaxlens.core._variables import AbstractVariable, Parameter


def _size(value: Any) -> int:
  return sum(int(np.prod(getattr(x, "shape", ()))) for x in jax.tree_util.tree_leaves(value))


def _own_counts(node: Any) -> tuple[int, int]:
  params = state = 0
  own = {k: v for k, v in node.attributes_dict().items() if k != "submodule_calls"}
  for leaf in jax.tree_util.tree_leaves(own, is_leaf=lambda x: isinstance(x, AbstractVariable)):
    if isinstance(leaf, Parameter):
      params += _size(leaf.value)
    elif isinstance(leaf, AbstractVariable):
      state += _size(leaf.value)
  return params, state


def _label(key: Any, node: Any) -> str:
  prefix = f"[dim]{key[0]}[/dim] " if key is not None else ""
  if not is_call_node(node):
    return f"{prefix}[bold magenta]{type(node).__name__}[/] [dim](replaces {key[1]})[/dim]"
  path, method = node.readable_path()
  params, state = _own_counts(node)
  counts = []
  if params:
    counts.append(f"{params:,} params")
  if state:
    counts.append(f"{state:,} state")
  extra = f" [green]{', '.join(counts)}[/]" if counts else ""
  return f"{prefix}[bold]{path or '<root>'}[/].{method} [cyan]{node.module_type.__name__}[/]{extra}"


def summary(tree: Any, max_depth: int | None = None) -> Tree:
  """An outline of the calls in a converted tree, as a `rich.tree.Tree`.

  Args:
    tree: a converted tree (for example from `fl.unflaxify`).
    max_depth: stop expanding below this many levels.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
    >>> x = jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> fl.summary(tree).children[0].label
    '[dim]0[/dim] [bold]layers_0[/].__call__ [cyan]Dense[/] [green]16 params[/]'
  """
  root = Tree(_label(None, tree))

  def add(parent: Tree, node: Any, depth: int) -> None:
    if max_depth is not None and depth >= max_depth:
      return
    for key, child in node.submodule_calls.items():
      branch = parent.add(_label(key, child))
      if is_call_node(child):
        add(branch, child, depth + 1)

  add(root, tree, 0)
  return root
