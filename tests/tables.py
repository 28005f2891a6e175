"""Reading back a table `fl.summary(...).text(width)` folded to a width."""

from __future__ import annotations

import re

_METHOD = 2  # The method column never folds: a line that fills it starts a row.


def folded_rows(text: str) -> list[list[str]]:
  """The rows of a folded table (header and total included), each cell's lines joined
  with the spaces left out: the columns are the spans of the first rule's dashes."""
  lines = text.splitlines()
  rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
  spans = [m.span() for m in re.finditer(r"-+", lines[rule])]
  rows: list[list[str]] = []
  for line in lines[rule - 1 : rule] + lines[rule + 1 :]:
    if line.startswith("---"):
      continue
    cells = [line[a:b] for a, b in spans]
    if cells[_METHOD].strip() or line.startswith("total") or not rows:
      rows.append(["" for _ in spans])
    rows[-1] = [kept + "".join(c.split()) for kept, c in zip(rows[-1], cells, strict=True)]
  return rows
