"""MkDocs hooks for the docs build: pages include sections of the README.

A page line `--8<-- "README.md:NAME"` is replaced by the README's lines between
`<!-- --8<-- [start:NAME] -->` and `<!-- --8<-- [end:NAME] -->`, so the getting-started
and known-limits pages never drift from the README. Links in the section are written for
the README at the repository root: `docs/page.md` becomes `page.md`, and a link to any
other file of the repository (outside the site) keeps its text and loses the link.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_INCLUDE = re.compile(r'^--8<-- "README\.md:([\w-]+)"$', re.MULTILINE)
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def _section(name: str) -> str:
  text = README.read_text(encoding="utf-8")
  start, end = f"<!-- --8<-- [start:{name}] -->\n", f"<!-- --8<-- [end:{name}] -->"
  if start not in text or end not in text:
    raise ValueError(f"README.md has no section {name!r}: add the {start.strip()} markers")
  return text.split(start, 1)[1].split(end, 1)[0]


def _relink(match: re.Match[str]) -> str:
  text, target = match.groups()
  if re.match(r"[a-z]+:|#", target):
    return match.group(0)
  if target.startswith("docs/"):
    return f"[{text}]({target.removeprefix('docs/')})"
  return text


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
  """Replaces each README include line by that section, its links made site-relative."""
  return _INCLUDE.sub(lambda m: _LINK.sub(_relink, _section(m.group(1))), markdown)
