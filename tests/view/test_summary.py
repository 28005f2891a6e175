"""`fl.summary`: a table of the calls that prints in a script and renders in rich and HTML."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx
from frameworks import LINEN, NNX, Wrap
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
  assert lines[0].split() == [
    "path",
    "module",
    "method",
    "inputs",
    "outputs",
    "params",
    "param",
    "bytes",
    "state",
  ]
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
  rows = [line.split() for line in out.splitlines()]
  assert [
    "layers_0",
    "Dense",
    "__call__",
    "float32[1,3]",
    "float32[1,4]",
    "16",
    "64",
    "B",
    "0",
  ] in rows
  assert [
    "layers_1",
    "Dense",
    "__call__",
    "float32[1,4]",
    "float32[1,2]",
    "10",
    "40",
    "B",
    "0",
  ] in rows
  assert ["total", "26", "104", "B", "0"] in rows


def test_rich_renders_the_summary_as_a_table():
  model, variables, x = _linen(linen_corpus.MLP)
  summary = fl.summary(fl.unflaxify(model, variables, x))
  console = Console(record=True, width=200)
  console.print(summary)
  text = console.export_text()
  for row in summary.rows:
    assert row.path in text
  assert "total" in text and f"{summary.params:,}" in text


@pytest.mark.parametrize("fw, name", [(LINEN, "mlp"), (NNX, "mlp")])
def test_a_notebook_renders_the_summary_as_an_html_table(corpora, fw, name):
  summary = fl.summary(fw.convert(corpora[fw][name]))
  page = summary._repr_html_()
  assert page.startswith("<table>") and page.endswith("</table>")
  for row in summary.rows:
    assert f"<td>{row.path or '&lt;root&gt;'}</td>" in page


def test_print_in_a_script_shows_an_nnx_table():
  script = textwrap.dedent(
    """
    import jax.numpy as jnp
    from flax import nnx
    import flaxlens as fl
    model, x = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0))), jnp.ones((1, 3))
    print(fl.summary(fl.unflaxify(model, x)))
    """
  )
  out = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, check=True
  ).stdout
  rows = [line.split() for line in out.splitlines()]
  assert [
    "layers/0",
    "Linear",
    "__call__",
    "float32[1,3]",
    "float32[1,4]",
    "16",
    "64",
    "B",
    "0",
  ] in rows
  assert ["total", "16", "64", "B", "0"] in rows


def _text(x) -> str:
  """An array as the documented `dtype[shape]` text."""
  return f"{x.dtype}[{','.join(str(d) for d in x.shape)}]"


@pytest.mark.parametrize(
  "fw, name, path",
  [(LINEN, "transformer", "TransformerBlock_1/Dense_0"), (NNX, "mlp", "hidden")],
)
def test_a_row_shows_the_shapes_and_dtypes_the_native_call_takes_and_returns(
  corpora, fw, name, path
):
  case = corpora[fw][name]
  seen = []

  def record(output, *args):
    seen.append((", ".join(_text(a) for a in args), _text(output)))
    return output

  fw.native(case, wrap=Wrap(path, record))
  row = next(row for row in fl.summary(fw.convert(case)).rows if row.path == path)
  assert [(row.inputs, row.outputs)] == seen


@pytest.mark.parametrize("fw, name", [(LINEN, "transformer"), (NNX, "mlp")])
def test_given_its_argument_the_root_row_shows_the_models_input_and_output(corpora, fw, name):
  case = corpora[fw][name]
  output, _ = fw.native(case)
  argument = fw.argument(case)
  root = fl.summary(fw.convert(case), argument=argument, **fw.side_inputs(case)).rows[0]
  assert (root.inputs, root.outputs) == (", ".join(map(_text, argument.args)), _text(output))


def test_an_output_whose_repr_spans_lines_is_shown_on_one_line(corpora):
  case = corpora[NNX]["capture_sow_perturb"]  # returns (array, nnx.State)
  root = fl.summary(NNX.convert(case), argument=NNX.argument(case)).rows[0]
  assert root.outputs.startswith("(float32[2,2], State({")
  assert "\n" not in root.outputs


def test_a_root_row_without_its_argument_shows_no_shapes():
  model, variables, x = _linen(linen_corpus.MLP)
  root = fl.summary(fl.unflaxify(model, variables, x)).rows[0]
  assert (root.inputs, root.outputs) == ("", "")


def test_keyword_and_python_arguments_show_by_name_and_value(corpora):
  case = corpora[NNX]["call_time_flags"]
  tree = NNX.convert(case)
  root = fl.summary(tree, argument=NNX.argument(case)).rows[0]
  assert root.inputs == f"{_text(nnx_corpus.X)}, train=True"


def test_a_path_filter_keeps_the_calls_the_same_pattern_selects():
  model, variables, x = _linen(linen_corpus.Transformer)
  tree = fl.unflaxify(model, variables, x)
  pattern = "TransformerBlock_*/Dense_*"
  rows = fl.summary(tree, path=pattern).rows
  selected = tree.select().at_path(pattern).get_sequence()
  assert [(row.path, row.method) for row in rows] == [n.readable_path() for n in selected]


def test_as_dict_holds_every_row_and_the_totals_for_json():
  model, variables, x = _linen(linen_corpus.MLP)
  summary = fl.summary(fl.unflaxify(model, variables, x))
  data = json.loads(json.dumps(summary.as_dict()))
  assert [row["path"] for row in data["rows"]] == [row.path for row in summary.rows]
  assert data["total"]["params"] == _size_and_bytes(variables["params"])[0]
