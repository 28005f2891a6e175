"""`fl.summary`: a table of the calls that prints in a script and renders in rich and HTML."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from linen import corpus as linen_corpus
from nnx import corpus as nnx_corpus
from replacements import PlusOne
from rich.console import Console

import flaxlens as fl


def _size_and_bytes(tree) -> tuple[int, int]:
  leaves = jax.tree_util.tree_leaves(tree)
  return sum(int(np.size(x)) for x in leaves), sum(int(x.nbytes) for x in leaves)


def _linen(module_cls):
  model = module_cls()
  x = linen_corpus.TOKENS if module_cls is linen_corpus.Transformer else linen_corpus.X
  variables = model.init(jax.random.key(0), x)
  return model, variables, x


def test_rows_follow_the_order_in_which_flax_makes_the_calls():
  model, variables, x = _linen(linen_corpus.Transformer)
  calls = []

  def record(next_fun, args, kwargs, context):
    if context.method_name != "setup":
      calls.append(("/".join(context.module.path), context.method_name))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    model.apply(variables, x)
  rows = fl.summary(fl.unflaxify(model, variables, x)).rows
  assert [(row.path, row.method) for row in rows] == calls


def test_a_linen_row_counts_the_parameters_its_module_owns():
  model, variables, x = _linen(linen_corpus.Transformer)
  rows = {row.path: row for row in fl.summary(fl.unflaxify(model, variables, x)).rows}
  dense = variables["params"]["TransformerBlock_1"]["Dense_0"]
  assert (
    rows["TransformerBlock_1/Dense_0"].params,
    rows["TransformerBlock_1/Dense_0"].param_bytes,
  ) == (_size_and_bytes(dense))
  assert rows["TransformerBlock_1"].params == 0
  assert rows["TransformerBlock_1"].module == "TransformerBlock"


def test_totals_count_a_module_called_twice_once():
  model, variables, x = _linen(linen_corpus.SharedParent)
  summary = fl.summary(fl.unflaxify(model, variables, x))
  assert [row.path for row in summary.rows] == ["", "shared", "shared"]
  assert (summary.params, summary.param_bytes) == _size_and_bytes(variables["params"])


def test_an_nnx_row_counts_the_parameters_and_state_its_module_owns():
  model = nnx_corpus.FlagNet(nnx_corpus.RNGS())
  summary = fl.summary(fl.unflaxify(model, nnx_corpus.X))
  rows = {row.path: row for row in summary.rows}
  norm_params = nnx.state(model.norm, nnx.Param)
  norm_stats = nnx.state(model.norm, nnx.BatchStat)
  assert (rows["norm"].module, rows["norm"].method) == ("BatchNorm", "__call__")
  assert (rows["norm"].params, rows["norm"].param_bytes) == _size_and_bytes(norm_params)
  assert rows["norm"].state == _size_and_bytes(norm_stats)[0]
  assert (summary.params, summary.param_bytes) == _size_and_bytes(nnx.state(model, nnx.Param))


def test_a_replaced_call_shows_the_replacing_layer_and_the_variables_it_holds():
  model, variables, x = _linen(linen_corpus.MLP)
  patched = fl.unflaxify(model, variables, x).select().at_path("Dense_1").apply(PlusOne)
  row = next(row for row in fl.summary(patched).rows if row.path == "Dense_1")
  assert (row.module, row.method, row.replaced) == ("PlusOne", "__call__", True)
  assert (row.params, row.param_bytes) == _size_and_bytes(variables["params"]["Dense_1"])
  assert "PlusOne (replacement)" in str(fl.summary(patched))


def test_max_depth_leaves_out_deeper_calls():
  model, variables, x = _linen(linen_corpus.Transformer)
  rows = fl.summary(fl.unflaxify(model, variables, x), max_depth=1).rows
  assert {row.depth for row in rows} == {0, 1}
  assert "TransformerBlock_0" in [row.path for row in rows]


def test_printing_a_summary_prints_one_line_per_call_and_the_totals(capsys):
  model, variables, x = _linen(linen_corpus.Transformer)
  summary = fl.summary(fl.unflaxify(model, variables, x))
  print(summary)
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].split() == ["path", "module", "method", "params", "param", "bytes", "state"]
  body = [line.split() for line in lines[2:-2]]
  assert [cells[0] for cells in body] == [row.path or "<root>" for row in summary.rows]
  assert lines[-1].split()[:2] == ["total", f"{summary.params:,}"]


def test_print_in_a_script_shows_the_table():
  script = textwrap.dedent(
    """
    import flax.linen as nn, jax, jax.numpy as jnp
    import flaxlens as fl
    model, x = nn.Sequential([nn.Dense(4), nn.Dense(2)]), jnp.ones((1, 3))
    print(fl.summary(fl.unflaxify(model, model.init(jax.random.key(0), x), x)))
    """
  )
  out = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, check=True
  ).stdout
  rows = [line.split()[:4] for line in out.splitlines()]
  assert ["layers_0", "Dense", "__call__", "16"] in rows
  assert ["layers_1", "Dense", "__call__", "10"] in rows
  assert ["total", "26", "104", "B"] in rows


def test_rich_renders_the_summary_as_a_table():
  model, variables, x = _linen(linen_corpus.MLP)
  summary = fl.summary(fl.unflaxify(model, variables, x))
  console = Console(record=True, width=200)
  console.print(summary)
  text = console.export_text()
  for row in summary.rows:
    assert row.path in text
  assert "total" in text and f"{summary.params:,}" in text


def test_a_notebook_renders_the_summary_as_an_html_table():
  model, variables, x = _linen(linen_corpus.MLP)
  page = fl.summary(fl.unflaxify(model, variables, x))._repr_html_()
  assert page.startswith("<table>") and page.endswith("</table>")
  assert "<td>&lt;root&gt;</td>" in page and "<td>Dense_1</td>" in page
