"""A table of the calls in a converted tree: one row per call, with its own variables.

`summary(tree)` walks the tree in execution order (each call before the calls it makes,
those in the order it makes them) and returns a `Summary`: `print(summary)` shows a plain
text table, rich renders it as a rich table, a notebook as HTML. A row counts the
variables the call's module owns (not its children's); the totals count each variable
of the tree once, so a module called twice is not counted twice. Replaced calls show
the class of the layer that replaces them. Works on Linen and NNX trees alike, through
the node attributes every call node has. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from rich.table import Table

from flaxlens.core._node import is_call_node
from flaxlens.core._variables import AbstractVariable, Parameter, variables_in

_HEADER = ("path", "module", "method", "params", "param bytes", "state")


@dataclasses.dataclass(frozen=True)
class SummaryRow:
  """One call: where it is, what runs it and the variables its module owns.

  Attributes:
    depth: how many calls enclose it (0 for the root).
    path: the module path (`"Block_0/Dense_0"`, `""` for the root).
    module: the module's class name, or for a replaced call the replacing layer's.
    method: the method called.
    params: the number of parameter values the module owns.
    param_bytes: the bytes they take.
    state: the number of state values (batch statistics, caches, counters) it owns.
    replaced: whether a layer replaces the call.
  """

  depth: int
  path: str
  module: str
  method: str
  params: int
  param_bytes: int
  state: int
  replaced: bool = False

  def _cells(self) -> tuple[str, ...]:
    module = f"{self.module} (replacement)" if self.replaced else self.module
    return (
      self.path or "<root>",
      module,
      self.method,
      f"{self.params:,}",
      _bytes(self.param_bytes),
      f"{self.state:,}",
    )


@dataclasses.dataclass(frozen=True)
class Summary:
  """The calls of a converted tree as a table; prints, renders with rich and in notebooks.

  Attributes:
    rows: one `SummaryRow` per call, in execution order.
    params: the number of parameter values in the tree, each variable counted once.
    param_bytes: the bytes they take.
    state: the number of state values in the tree.
  """

  rows: tuple[SummaryRow, ...]
  params: int
  param_bytes: int
  state: int

  def _cells(self) -> list[tuple[str, ...]]:
    total = ("total", "", "", f"{self.params:,}", _bytes(self.param_bytes), f"{self.state:,}")
    return [row._cells() for row in self.rows] + [total]

  def __str__(self) -> str:
    lines = [_HEADER, *self._cells()]
    widths = [max(len(line[i]) for line in lines) for i in range(len(_HEADER))]
    numeric = range(3, len(_HEADER))

    def render(cells: tuple[str, ...]) -> str:
      return "  ".join(
        c.rjust(w) if i in numeric else c.ljust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
      ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    body = [render(cells) for cells in lines]
    return "\n".join([body[0], rule, *body[1:-1], rule, body[-1]])

  def __repr__(self) -> str:
    return str(self)

  def __rich__(self) -> Table:
    table = Table(show_footer=False)
    for i, name in enumerate(_HEADER):
      table.add_column(name, justify="right" if i >= 3 else "left", overflow="fold")
    cells = self._cells()
    for row, line in zip(self.rows, cells, strict=False):
      table.add_row(*line, style="magenta" if row.replaced else None)
    table.add_section()
    table.add_row(*cells[-1], style="bold")
    return table

  def _repr_html_(self) -> str:
    def row(cells: Iterable[str], tag: str) -> str:
      return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"

    head = row(_HEADER, "th")
    body = "".join(row(cells, "td") for cells in self._cells())
    return f"<table><thead>{head}</thead><tbody>{body}</tbody></table>"


def _leaves(variables: Iterable[AbstractVariable]) -> Iterator[tuple[bool, Any]]:
  for variable in variables:
    for leaf in jax.tree_util.tree_leaves(variable.value):
      yield isinstance(variable, Parameter), leaf


def _counts(variables: Iterable[AbstractVariable]) -> tuple[int, int, int]:
  params = param_bytes = state = 0
  for is_param, leaf in _leaves(variables):
    size = int(np.prod(np.shape(leaf)))
    if not is_param:
      state += size
      continue
    params += size
    if hasattr(leaf, "dtype"):
      param_bytes += size * np.dtype(leaf.dtype).itemsize
  return params, param_bytes, state


def _own_variables(node: Any) -> tuple[AbstractVariable, ...]:
  """The variables a call's module owns: every field of the node but its children."""
  own = {k: v for k, v in node.attributes_dict().items() if k != "submodule_calls"}
  return variables_in(own)


def _rows(node: Any, depth: int, max_depth: int | None) -> Iterator[SummaryRow]:
  path, method = node.readable_path()
  counts = _counts(_own_variables(node))
  yield SummaryRow(depth, path, node.module_type.__name__, method, *counts)
  if max_depth is not None and depth >= max_depth:
    return
  for (_, name), child in node.submodule_calls.items():
    if is_call_node(child):
      yield from _rows(child, depth + 1, max_depth)
    else:
      child_path, _, child_method = name.rpartition(".")
      if not child_path.startswith("/"):
        child_path = "/".join(p for p in (path, child_path) if p)
      counts = _counts(variables_in(child))
      yield SummaryRow(
        depth + 1, child_path.lstrip("/"), type(child).__name__, child_method, *counts, True
      )


def summary(tree: Any, max_depth: int | None = None) -> Summary:
  """A table of the calls in a converted tree, in execution order, with their variables.

  Args:
    tree: a converted tree (for example from `fl.unflaxify`).
    max_depth: leave out calls nested deeper than this below the root.

  Returns:
    A `Summary`: `print` it for a plain text table; rich and notebooks render it too.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
    >>> x = jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> print(fl.summary(tree))
    path      module      method    params  param bytes  state
    --------  ----------  --------  ------  -----------  -----
    <root>    Sequential  __call__       0          0 B      0
    layers_0  Dense       __call__      16         64 B      0
    layers_1  Dense       __call__      10         40 B      0
    --------  ----------  --------  ------  -----------  -----
    total                               26        104 B      0
  """
  rows = tuple(_rows(tree, 0, max_depth))
  return Summary(rows, *_counts(variables_in(tree)))


def _bytes(n: int) -> str:
  size, units = float(n), ("KiB", "MiB", "GiB", "TiB")
  if n < 1024:
    return f"{n} B"
  for unit in units:
    size /= 1024
    if size < 1024 or unit == units[-1]:
      break
  return f"{size:.1f} {unit}"
