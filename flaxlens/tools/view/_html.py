"""`to_html`: a converted tree as one self-contained web page, opened from a file.

The page holds the call table of `summary` and treescope's interactive rendering of the
tree (fold and unfold any node, copy a node's path). treescope's output carries its own
scripts and styles, so the page needs no server and no network: open the file in a
browser. No Flax internals here.
"""

from __future__ import annotations

import html
import os
from typing import Any

import treescope

from flaxlens.core._args import ArgsAndKwargs
from flaxlens.core._checks import check_optional, check_path
from flaxlens.tools.view._summary import check_arguments, summary

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
table.flaxlens-summary { border-collapse: collapse; font-family: monospace; font-size: 0.9em; }
table.flaxlens-summary th, table.flaxlens-summary td {
  border-bottom: 1px solid #ddd; padding: 0.2em 0.8em; text-align: left; white-space: nowrap;
}
table.flaxlens-summary :is(td, th):nth-child(n+6) { text-align: right; }
table.flaxlens-summary tr:last-child td { font-weight: bold; border-top: 2px solid #888; }
"""


def to_html(
  tree: Any,
  path: str | os.PathLike[str] | None = None,
  *,
  max_depth: int | None = None,
  argument: ArgsAndKwargs | None = None,
  **side_inputs: Any,
) -> str:
  """A self-contained web page of a converted tree: its call table and the tree itself.

  The page shows `fl.summary(tree)` (every call in execution order with its input and
  output shapes and its parameters) and treescope's interactive rendering of the tree,
  in which every node folds and unfolds. It needs no server and no network.

  Args:
    tree: a converted tree (for example from `fl.unflaxify`).
    path: if given, the file the page is written to (UTF-8).
    max_depth: leave out of the table the calls nested deeper than this below the root,
      as `fl.summary` does (`flaxlens inspect --depth N --html FILE`); the tree below
      still holds every call, to unfold.
    argument: the root call's `fl.ArgsAndKwargs`, so that the table's first row shows
      the model's input and output too (see `fl.summary`).
    **side_inputs: side inputs of the root call (such as `random_streams`), used with
      `argument`.

  Returns:
    The page's HTML source.

  Raises:
    ArgumentError: `tree` is not a converted tree, `path` not a file path, or
      `argument` not an `fl.ArgsAndKwargs`.

  Example:
    >>> import flaxlens as fl, flax.linen as nn, jax, jax.numpy as jnp
    >>> model, x = nn.Dense(2), jnp.ones((1, 3))
    >>> tree = fl.unflaxify(model, model.init(jax.random.key(0), x), x)
    >>> page = fl.to_html(tree)
    >>> page.startswith("<!DOCTYPE html>"), "Dense" in page
    (True, True)
  """
  check_arguments("fl.to_html", tree, argument)
  check_optional(
    max_depth, int, "fl.to_html", "max_depth", "an int or None", "Pass a depth such as 2."
  )
  if path is not None:
    path = check_path(path, "fl.to_html", "Pass the file to write, or None for no file.")
  table = summary(tree, max_depth, argument=argument, **side_inputs)._repr_html_()
  table = table.replace("<table>", '<table class="flaxlens-summary">', 1)
  title = html.escape(f"flaxlens: {tree.where()}")
  page = (
    "<!DOCTYPE html>\n"
    '<html lang="en"><head><meta charset="utf-8">'
    '<link rel="icon" href="data:,">'
    f"<title>{title}</title><style>{_STYLE}</style></head>\n"
    f"<body><h1>{title}</h1>\n"
    f"<h2>Calls, in execution order</h2>\n{table}\n"
    f'<h2>Tree</h2>\n<div class="flaxlens-tree">{treescope.render_to_html(tree)}</div>\n'
    "</body></html>\n"
  )
  if path is not None:
    with open(path, "w", encoding="utf-8") as f:
      f.write(page)
  return page
