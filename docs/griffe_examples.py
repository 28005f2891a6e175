"""A griffe extension for the docs build: an `Example:` section renders as examples.

flaxlens docstrings follow the Google style guide, which writes `Example:`; griffe's
Google parser knows only `Examples:` and would show the doctest lines as plain text. The
extension renames the section header of every object it loads, so mkdocstrings renders
the doctests as Python sessions.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADER = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
  """Renames `Example:` section headers to `Examples:` in every loaded docstring."""

  def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    if obj.docstring is not None:
      obj.docstring.value = _HEADER.sub(r"\1Examples:", obj.docstring.value)
