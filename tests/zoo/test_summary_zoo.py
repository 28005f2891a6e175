"""The call table of Hugging Face's Flax GPT-2, folded to a terminal's width."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from tables import folded_rows

import flaxlens as fl

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("width", [80, 120])
def test_gpt2s_table_fits_a_terminal_folding_the_keyword_arguments_losing_nothing(gpt2, width):
  argument = fl.ArgsAndKwargs.capture(*gpt2.args, **gpt2.kwargs)
  table = fl.summary(gpt2.convert(), argument=argument, random_streams=gpt2.rngs)
  text = table.text(width)
  assert max(len(line) for line in text.splitlines()) <= width
  rows = folded_rows(text)
  assert rows[0] == [
    "path",
    "module",
    "method",
    "inputs",
    "outputs",
    "params",
    "parambytes",
    "state",
  ]
  unfolded = folded_rows(table.text())[1:]  # One line a call: nothing folded.
  assert rows[1:] == unfolded
  attention = next(cells for cells in rows if cells[0] == "transformer/h/0/attn")
  assert "output_attentions=False" in attention[3]  # GPT-2's own keyword, read back whole.


@pytest.mark.parametrize("width", [80, 120])
def test_gpt2s_table_rendered_by_rich_fits_a_terminal_losing_nothing(gpt2, width):
  argument = fl.ArgsAndKwargs.capture(*gpt2.args, **gpt2.kwargs)
  table = fl.summary(gpt2.convert(), argument=argument, random_streams=gpt2.rngs)
  console = Console(record=True, width=width, file=io.StringIO())
  console.print(table)
  text = console.export_text()
  assert max(len(line) for line in text.splitlines()) <= width
  body = [line.split("│")[1:-1] for line in text.splitlines() if line.startswith("│")]
  shown = ["".join("".join(cells[i].split()) for cells in body) for i in range(8)]
  rows = folded_rows(table.text())[1:]
  assert shown == ["".join(cells[i] for cells in rows) for i in range(8)]
