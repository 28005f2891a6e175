"""A table of the calls in a converted tree: one row per call, with its own variables.

`summary(tree)` walks the tree in execution order (each call before the calls it makes,
those in the order it makes them) and returns a `Summary`: `print(summary)` shows a plain
text table, rich renders it as a rich table, a notebook as HTML, and `as_dict()` is the
same data for machines (`flaxlens inspect --json`). A row shows the shapes and dtypes of
the call's arguments and output, as conversion recorded them in the caller's `CallSpec`s
(the root's, which has no caller, when its argument is given), and counts the variables
the call's module owns (not its children's); the totals count each variable of the tree
once, so a module called twice is not counted twice. Replaced calls show the class of the
layer that replaces them. Works on Linen and NNX trees alike, through the node
attributes every call node has. No Flax internals here.
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from rich.table import Table

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._checks import check_optional
from flaxlens.core._convert import split_static
from flaxlens.core._node import check_tree, is_call_node
from flaxlens.core._selectors import path_matches
from flaxlens.core._spec import CallSpec, signature
from flaxlens.core._variables import AbstractVariable, Parameter, unbind_variables, variables_in

_HEADER = ("path", "module", "method", "inputs", "outputs", "params", "param bytes", "state")
_NUMERIC = 5  # Columns from this one on hold numbers, aligned right.


@dataclasses.dataclass(frozen=True)
class SummaryRow:
  """One call: where it is, what runs it and the variables its module owns.

  Attributes:
    depth: how many calls enclose it (0 for the root).
    path: the module path (`"Block_0/Dense_0"`, `""` for the root).
    module: the module's class name, or for a replaced call the replacing layer's.
    method: the method called.
    inputs: the call's arguments as conversion saw them, arrays as `dtype[shape]`
      (`"float32[2,8], train=True"`; inside `nn.scan`/`nn.vmap`/`nnx.scan`/`nnx.vmap`
      bodies, as one iteration sees them); empty for the root unless `summary` was
      given its argument.
    outputs: the call's output, written the same way.
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
  inputs: str = ""
  outputs: str = ""

  def _cells(self) -> tuple[str, ...]:
    module = f"{self.module} (replacement)" if self.replaced else self.module
    return (
      self.path or "<root>",
      module,
      self.method,
      self.inputs,
      self.outputs,
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
    blank = ("",) * (_NUMERIC - 1)
    total = ("total", *blank, f"{self.params:,}", _bytes(self.param_bytes), f"{self.state:,}")
    return [row._cells() for row in self.rows] + [total]

  def as_dict(self) -> dict[str, Any]:
    """The table as plain data (`json.dumps` takes it): `{"rows": [...], "total": {...}}`.

    Each row is a `SummaryRow`'s fields by name; the total has `params`, `param_bytes`
    and `state`.
    """
    return {
      "rows": [dataclasses.asdict(row) for row in self.rows],
      "total": {"params": self.params, "param_bytes": self.param_bytes, "state": self.state},
    }

  def text(self, width: int | None = None) -> str:
    """The plain text table, its lines at most `width` characters if given.

    What does not fit is folded, never cut: the inputs and outputs columns (where a
    Hugging Face model's keyword arguments go) narrow first, then with the path and
    module columns, the widest first, and their cells continue on the next lines, broken
    after a space where they can be. The method and number columns keep their width, so
    a table is wider than a `width` under some 70 characters. `str(summary)` is
    `summary.text()`: one line per call, however wide. `flaxlens inspect` prints the
    table at the terminal's width.

    Example:
      >>> import flaxlens as fl, flax.linen as nn, jax.numpy as jnp
      >>> model, x = nn.Dropout(0.5), jnp.ones((1, 3))
      >>> tree = fl.unflaxify(model, {}, x, deterministic=True)
      >>> argument = fl.ArgsAndKwargs.capture(x, deterministic=True)
      >>> print(fl.summary(tree, argument=argument).text(width=90))
      path    module   method    inputs                 outputs       params  param bytes  state
      ------  -------  --------  ---------------------  ------------  ------  -----------  -----
      <root>  Dropout  __call__  float32[1,3],          float32[1,3]       0          0 B      0
                                 deterministic=True
      ------  -------  --------  ---------------------  ------------  ------  -----------  -----
      total                                                                0          0 B      0
    """
    lines = [_HEADER, *self._cells()]
    widths = _fitted([max(len(line[i]) for line in lines) for i in range(len(_HEADER))], width)
    rule = "  ".join("-" * w for w in widths)
    body = ["\n".join(_render(cells, widths)) for cells in lines]
    return "\n".join([body[0], rule, *body[1:-1], rule, body[-1]])

  def __str__(self) -> str:
    return self.text()

  def __repr__(self) -> str:
    return str(self)

  def __rich__(self) -> Table:
    table = Table(show_footer=False)
    for i, name in enumerate(_HEADER):  # The method and numbers never fold, as in `text`.
      folds = i in _FOLDING
      justify = "right" if i >= _NUMERIC else "left"
      table.add_column(name, justify=justify, overflow="fold", no_wrap=not folds)
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


# The columns that narrow to fit a width, folding their cells: inputs and outputs first,
# down to `_ROOMY` characters, then with the path and module, down to their headers.
_ARGUMENTS, _FOLDING = (3, 4), (0, 1, 3, 4)
_ROOMY = 24
_NARROWEST = 6  # A folding column is never narrower than this, nor than its header.


def _fitted(widths: list[int], width: int | None) -> list[int]:
  """Column widths whose table (two spaces between columns) is at most `width` wide."""
  if width is None:
    return widths
  widths = _narrowed(widths, width, _ARGUMENTS, _ROOMY)
  return _narrowed(widths, width, _FOLDING, _NARROWEST)


def _narrowed(widths: list[int], width: int, columns: tuple[int, ...], floor: int) -> list[int]:
  """`widths` with the `columns` cut down to the largest common limit (not below `floor`
  nor their header) at which the table fits `width`: the widest narrow first."""
  least = {i: min(widths[i], max(len(_HEADER[i]), floor)) for i in columns}

  def cut(limit: int) -> list[int]:
    return [max(least[i], min(w, limit)) if i in columns else w for i, w in enumerate(widths)]

  limit = max(widths[i] for i in columns)
  while limit > floor and sum(cut(limit)) + 2 * (len(widths) - 1) > width:
    limit -= 1
  return cut(limit)


def _fold(text: str, width: int) -> list[str]:
  """`text` in lines of at most `width` characters, broken after a space, a comma or a
  slash where it can be (`float32[2,8], train=True`, `Block_0/Dense_0`), mid-word where
  it must; nothing but the spaces at the breaks is left out."""
  lines = [""]
  for word in re.findall(r"[^\s,/]*[,/]?\s*", text):  # Each with its trailing spaces.
    if lines[-1] and len((lines[-1] + word).rstrip()) > width:
      lines.append("")
    lines[-1] += word
    while len(lines[-1].rstrip()) > width:  # A word longer than a line: cut it.
      lines[-1], rest = lines[-1][:width], lines[-1][width:]
      lines.append(rest)
  return [line.rstrip() for line in lines]


def _render(cells: tuple[str, ...], widths: list[int]) -> list[str]:
  """The lines of one table row, each cell folded to its column's width (`_fold`),
  numbers aligned right."""
  folded = [_fold(cell, w) for cell, w in zip(cells, widths, strict=True)]
  height = max(len(lines) for lines in folded)
  return [
    "  ".join(
      (lines[n] if n < len(lines) else "").rjust(w)
      if i >= _NUMERIC
      else (lines[n] if n < len(lines) else "").ljust(w)
      for i, (lines, w) in enumerate(zip(folded, widths, strict=True))
    ).rstrip()
    for n in range(height)
  ]


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


class _Leaf:
  """Stands for one leaf of a recorded signature: its repr is the given text."""

  __slots__ = ("text",)

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


def _leaf_text(leaf: Any) -> _Leaf:
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return _Leaf(f"{leaf.dtype}[{','.join(str(d) for d in leaf.shape)}]")
  return _Leaf(repr(leaf))


def _shown(signature: tuple[Any, tuple[Any, ...]] | None) -> Any:
  """The recorded value with each leaf replaced by its text (`float32[2,8]`)."""
  if signature is None:
    return _Leaf("?")
  treedef, leaves = signature
  return jax.tree_util.tree_unflatten(treedef, [_leaf_text(x) for x in leaves])


def _one_line(text: str) -> str:
  """A table cell: the text with each run of whitespace (newlines too) made one space."""
  return " ".join(text.split())


def _inputs_text(signature: tuple[Any, tuple[Any, ...]] | None) -> str:
  shown = _shown(signature)
  if isinstance(shown, _Leaf):
    return shown.text
  args, kwargs = shown
  cells = [*(repr(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())]
  return _one_line(", ".join(cells))


def _output_text(signature: tuple[Any, tuple[Any, ...]] | None) -> str:
  return _one_line(repr(_shown(signature)))


def _io(spec: CallSpec | None) -> dict[str, str]:
  """The inputs and outputs texts of a row, from what conversion saw of the call."""
  if spec is None:
    return {}
  return {"inputs": _inputs_text(spec.inputs), "outputs": _output_text(spec.output)}


def _rows(node: Any, depth: int, max_depth: int | None, io: dict[str, str]) -> Iterator[SummaryRow]:
  path, method = node.readable_path()
  counts = _counts(_own_variables(node))
  yield SummaryRow(depth, path, node.module_type.__name__, method, *counts, **io)
  if max_depth is not None and depth >= max_depth:
    return
  specs = {spec.key: spec for spec in node.call_specs}
  for key, child in node.submodule_calls.items():
    child_io = _io(specs.get(key))
    if is_call_node(child):
      yield from _rows(child, depth + 1, max_depth, child_io)
    else:
      child_path, _, child_method = key[1].rpartition(".")
      if not child_path.startswith("/"):
        child_path = "/".join(p for p in (path, child_path) if p)
      counts = _counts(variables_in(child))
      yield SummaryRow(
        depth + 1,
        child_path.lstrip("/"),
        type(child).__name__,
        child_method,
        *counts,
        replaced=True,
        **child_io,
      )


def _root_io(tree: Any, argument: ArgsAndKwargs, side_inputs: dict[str, Any]) -> dict[str, str]:
  """The root call's input and output, its output traced abstractly (`jax.eval_shape`)."""
  unbound, values = unbind_variables(tree, freeze=True)
  arrays, rebuild = split_static((argument, side_inputs))

  def run(arrays: list[Any]) -> Any:
    given, side = rebuild(arrays)
    return unbound.stateless_call(values, given, **side)[0]

  output = jax.eval_shape(run, arrays)
  inputs = signature((tuple(argument.args), dict(argument.kwargs)))
  return {"inputs": _inputs_text(inputs), "outputs": _output_text(signature(output))}


def summary(
  tree: Any,
  max_depth: int | None = None,
  *,
  path: str | None = None,
  argument: ArgsAndKwargs | None = None,
  **side_inputs: Any,
) -> Summary:
  """A table of the calls in a converted tree, in execution order, with their variables.

  Each row shows the call's arguments and output (shapes and dtypes, as conversion saw
  them), and the parameters and state its module owns; the totals count each variable
  of the tree once.

  Args:
    tree: a converted tree (for example from `fl.unflaxify`).
    max_depth: leave out calls nested deeper than this below the root.
    path: keep only the calls whose path matches this pattern, in the syntax of
      `tree.select().at_path` (`"Block_*/Dense_0"`, `"**/attention"`, with or without
      `.method`). The totals still count the whole tree.
    argument: the root call's `fl.ArgsAndKwargs`. Conversion records the arguments and
      output of every call but the root's; given this, the root row shows them too
      (traced abstractly: no FLOPs).
    **side_inputs: side inputs of the root call (such as `random_streams`), used with
      `argument`.

  Returns:
    A `Summary`: `print` it for a plain text table; rich and notebooks render it too,
    and `as_dict()` gives the same data for `json.dumps`.

  Raises:
    ArgumentError: `tree` is not a converted tree, or another argument is not of the
      kind above.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
    >>> x = jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> print(fl.summary(tree, argument=fl.ArgsAndKwargs.capture(x)))
    path      module      method    inputs        outputs       params  param bytes  state
    --------  ----------  --------  ------------  ------------  ------  -----------  -----
    <root>    Sequential  __call__  float32[1,3]  float32[1,2]       0          0 B      0
    layers_0  Dense       __call__  float32[1,3]  float32[1,4]      16         64 B      0
    layers_1  Dense       __call__  float32[1,4]  float32[1,2]      10         40 B      0
    --------  ----------  --------  ------------  ------------  ------  -----------  -----
    total                                                           26        104 B      0
  """
  check_arguments("fl.summary", tree, argument)
  check_optional(
    max_depth, int, "fl.summary", "max_depth", "an int or None", "Pass a depth such as 2."
  )
  check_optional(
    path, str, "fl.summary", "path", "a path pattern (a str) or None", 'Pass path="Block_*".'
  )
  io = {} if argument is None else _root_io(tree, argument, side_inputs)
  rows = _rows(tree, 0, max_depth, io)
  if path is not None:
    rows = (r for r in rows if path_matches(path, r.path) or path_matches(path, _where(r)))
  return Summary(tuple(rows), *_counts(variables_in(tree)))


def check_arguments(where: str, tree: Any, argument: Any) -> None:
  """Refuses a `tree` that is not a converted tree, an `argument` not an `ArgsAndKwargs`."""
  check_tree(tree, where)
  check_optional(
    argument,
    ArgsAndKwargs,
    where,
    "argument",
    "the root call's fl.ArgsAndKwargs",
    "Pass argument=fl.ArgsAndKwargs.capture(*args, **kwargs).",
  )


def _where(row: SummaryRow) -> str:
  return f"{row.path}.{row.method}"


def _bytes(n: int) -> str:
  size, units = float(n), ("KiB", "MiB", "GiB", "TiB")
  if n < 1024:
    return f"{n} B"
  for unit in units:
    size /= 1024
    if size < 1024 or unit == units[-1]:
      break
  return f"{size:.1f} {unit}"
