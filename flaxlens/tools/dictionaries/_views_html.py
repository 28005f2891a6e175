"""The web page of feature views: one self-contained file, opened from disk.

Each feature gets a section: how often it is active, its histogram drawn as inline SVG
bars, the tokens its decoder direction promotes and suppresses, and its top contexts with
the row's own token marked and shaded by the activation. The page's styles are inline,
it has no script but the views' data as JSON (`<script type="application/json">`, for
programs reading the page), and it names no other resource: no server, no network. It
reads `_views`' data classes (`FeatureViews` and what it holds), annotated `Any` here as
`_views` imports this module to write the page. No Flax internals here.
"""

from __future__ import annotations

import html
import json
import os
from typing import Any

from flaxlens.core._checks import check_path

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 72em; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.8em; border-top: 1px solid #ccc;
  padding-top: 0.8em; }
h3 { font-size: 0.95em; margin: 0.8em 0 0.3em; }
nav a { margin-right: 0.6em; }
.stats { color: #555; }
.columns { display: flex; gap: 2em; flex-wrap: wrap; align-items: flex-start; }
table.tokens { border-collapse: collapse; font-family: monospace; font-size: 0.9em; }
table.tokens td { padding: 0.1em 0.6em; border-bottom: 1px solid #eee; }
table.tokens td.logit { text-align: right; }
.promoted td.logit { color: #1a6b2a; } .suppressed td.logit { color: #a3222d; }
ol.contexts { font-family: monospace; font-size: 0.9em; padding-left: 2.5em; }
ol.contexts li { margin: 0.15em 0; }
.token { white-space: pre; border-radius: 2px; margin-right: 1px; background: #f2f2f2; }
.token.center { outline: 1px solid #c05a00; font-weight: bold; }
.where { color: #888; margin-left: 1em; }
svg.histogram rect { fill: #4a78b5; }
svg.histogram text { font-size: 10px; fill: #555; }
"""


def _token_text(text: str | None, token: int) -> str:
  """A token's text as shown: whitespace made visible, or its id without a vocabulary."""
  if text is None:
    return f"[{token}]"
  return text.replace("\n", "\u21b5").replace("\t", "\u2192") or "\u2205"


def _context_html(context: Any, largest: float) -> str:
  where = f"example {context.example}, position {context.position}"
  value = f"{context.activation:.4g}"
  if context.ids is None:
    return f'<li><span class="activation">{value}</span><span class="where">{where}</span></li>'
  shown = []
  for number, token in enumerate(context.ids):
    text = html.escape(_token_text(None if context.texts is None else context.texts[number], token))
    if number == context.center:
      shade = min(1.0, abs(context.activation) / largest) if largest else 1.0
      shown.append(
        f'<span class="token center" style="background: rgba(230, 120, 20, {shade:.3f})"'
        f' title="activation {value}">{text}</span>'
      )
    else:
      shown.append(f'<span class="token">{text}</span>')
  return f'<li>{"".join(shown)}<span class="where">{value}; {where}</span></li>'


def _histogram_svg(histogram: Any) -> str:
  """The histogram as inline SVG bars, with the range of values under them."""
  width, height, gap = 320, 90, 1
  counts = [int(c) for c in histogram.counts]
  tallest = max(counts) or 1
  bar = width / len(counts)
  bars = "".join(
    f'<rect x="{i * bar:.2f}" y="{height - count / tallest * height:.2f}"'
    f' width="{max(bar - gap, 0.5):.2f}" height="{count / tallest * height:.2f}">'
    f"<title>{histogram.edges[i]:.4g} to {histogram.edges[i + 1]:.4g}: {count}</title></rect>"
    for i, count in enumerate(counts)
  )
  low, high = f"{histogram.edges[0]:.3g}", f"{histogram.edges[-1]:.3g}"
  return (
    f'<svg class="histogram" width="{width}" height="{height + 14}" role="img"'
    f' aria-label="activation histogram">{bars}'
    f'<text x="0" y="{height + 12}">{low}</text>'
    f'<text x="{width}" y="{height + 12}" text-anchor="end">{high}</text></svg>'
  )


def _tokens_table(scores: tuple[Any, ...], kind: str) -> str:
  rows = "".join(
    f'<tr><td class="text">{html.escape(_token_text(score.text, score.id))}</td>'
    f'<td class="id">{score.id}</td><td class="logit">{score.logit:+.4g}</td></tr>'
    for score in scores
  )
  return f'<table class="tokens {kind}">{rows}</table>'


def _section(view: Any) -> str:
  histogram = view.histogram
  stats = (
    f"active on {histogram.active:,} of {histogram.rows:,} rows"
    f" ({100 * histogram.fraction_active:.3g}%)"
  )
  largest = max((abs(c.activation) for c in view.contexts), default=0.0)
  if view.contexts:
    stats += f"; largest {largest:.4g}"
  parts = [
    f'<section class="feature" id="feature-{view.feature}" data-feature="{view.feature}">',
    f"<h2>Feature {view.feature}</h2>",
    f'<p class="stats">{stats}</p>',
    '<div class="columns"><div><h3>Activations (nonzero)</h3>',
    _histogram_svg(histogram),
    "</div>",
  ]
  if view.promoted or view.suppressed:
    parts += [
      "<div><h3>Promotes</h3>",
      _tokens_table(view.promoted, "promoted"),
      "</div><div><h3>Suppresses</h3>",
      _tokens_table(view.suppressed, "suppressed"),
      "</div>",
    ]
  parts.append("</div><h3>Top contexts</h3>")
  if view.contexts:
    items = "".join(_context_html(context, largest) for context in view.contexts)
    parts.append(f'<ol class="contexts">{items}</ol>')
  else:
    parts.append('<p class="stats">never active on the rows read</p>')
  parts.append("</section>")
  return "\n".join(parts)


def page(views: Any) -> str:
  """The page's HTML source."""
  config = views.dictionary
  kind = {"sae": "SAE", "transcoder": "transcoder", "clt": "cross-layer transcoder"}
  layer = "" if views.layer is None else f", layer {views.layer}"
  title = html.escape(
    f"flaxlens: features of a {config['width']}-feature {config['activation']}"
    f" {kind.get(config['kind'], config['kind'])} on {views.site}{layer}"
  )
  links = " ".join(f'<a href="#feature-{f}">{f}</a>' for f in views.features)
  # `</` closed inside the JSON, so no string in it ends the script element early.
  data = json.dumps(views.to_dict()).replace("</", "<\\/")
  return (
    "<!DOCTYPE html>\n"
    '<html lang="en"><head><meta charset="utf-8">'
    '<link rel="icon" href="data:,">'
    f"<title>{title}</title><style>{_STYLE}</style></head>\n"
    f"<body><h1>{title}</h1>\n"
    f'<p class="stats">harvest {html.escape(views.store)}</p>\n'
    f"<nav>Features: {links}</nav>\n"
    + "\n".join(_section(view) for view in views.views)
    + f'\n<script type="application/json" id="flaxlens-features">{data}</script>\n'
    "</body></html>\n"
  )


def write_page(views: Any, path: str | os.PathLike[str] | None) -> str:
  """The page of `views`, written to `path` when given; returns its source."""
  if path is not None:
    path = check_path(path, "FeatureViews.to_html", "Pass the file to write, or None.")
  source = page(views)
  if path is not None:
    with open(path, "w", encoding="utf-8") as file:
      file.write(source)
  return source
