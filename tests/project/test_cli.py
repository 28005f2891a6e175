"""The command line, run as a user runs it: `python -m flaxlens.cli ...` in a subprocess.

Checks that need no fresh process (argument handling, the messages for bad TARGETs) call
`cli.main` in-process, which is what the `flaxlens` script runs.
"""

from __future__ import annotations

import html
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx
from tables import folded_rows

import flaxlens as fl
from flaxlens import _demo, cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "inspect_targets.py"


def _run(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  return subprocess.run(
    [sys.executable, "-m", "flaxlens.cli", *argv], capture_output=True, text=True, env=env, cwd=cwd
  )


def _examples():
  spec = importlib.util.spec_from_file_location("inspect_targets_under_test", EXAMPLES)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def _table_rows(out: str) -> list[list[str]]:
  """The body rows of a printed table, split into cells at runs of two spaces or more."""
  lines = out.splitlines()
  rules = [i for i, line in enumerate(lines) if line.startswith("---")]
  return [re.split(r"\s{2,}", line.strip()) for line in lines[rules[0] + 1 : rules[1]]]


def _size(tree) -> int:
  return sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(tree))


@pytest.fixture(scope="module")
def demo_run() -> subprocess.CompletedProcess:
  """`flaxlens demo` as the README's `pip install -e .` runs it: without matplotlib and
  TensorStore, which only the `plots` and `harvest` extras install (hidden from the
  command's process)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  base_install = (
    "import sys; sys.modules['matplotlib'] = None; sys.modules['tensorstore'] = None;"
    " from flaxlens.cli import main; sys.exit(main(sys.argv[1:]))"
  )
  return subprocess.run(
    [sys.executable, "-c", base_install, "demo"],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
  )


def test_demo_says_it_is_importing_before_anything_else(demo_run):
  done = demo_run
  assert done.stdout.splitlines()[0] == "flaxlens demo: importing JAX and Flax ..."


def test_demo_tells_the_whole_story_and_proves_each_step(demo_run):
  done = demo_run
  assert done.returncode == 0, done.stderr
  for proof in (
    "tree(tokens) == model.apply(variables, tokens) bit for bit: True",
    "adding 1 to the head's bias shifts every logit by 1: True",
    "the capturing run's logits equal jax.jit(model.apply)'s bit for bit: True",
    "20 steering strengths, one compilation: True",
    "the sweep's (Block_0, position 2) cell equals that single patch: True",
    "saved, then `flaxlens replay` in a fresh process: exact: True",
    "the edited tree and model.apply(tree.export(), ...) agree bit for bit: True",
    "tree(x) == model(x) bit for bit: True",
    "the tree's batch statistics follow the model's after the call: True",
    "the sweep's Block_1 head 2 cell equals patching that head alone: True",
    "head 0's row equals the two patched runs written by hand with fl.patch: True",
  ):
    assert proof in done.stdout
  assert "Block_1/MultiHeadDotProductAttention_0" in done.stdout


def test_the_readme_excerpt_is_what_demo_prints_in_that_order(demo_run):
  readme = (ROOT / "README.md").read_text()
  excerpt = re.search(r"```text\n(flaxlens demo: .*?)```", readme, flags=re.S).group(1)
  # The README shows the default cache folder and `/tmp/flaxlens-demo-…` for the run's own.
  out = demo_run.stdout.replace(os.environ["FLAXLENS_COMPILATION_CACHE"], "~/.cache/flaxlens/jax")
  out = re.sub(r"\S*flaxlens-demo-\w+", "/tmp/flaxlens-demo-…", out)
  printed = iter(out.splitlines())
  for line in filter(None, excerpt.splitlines()):
    # Numbers (`2.1326`, compilations read from the cache) may differ with the JAX
    # version and the cache; their place may not. A line ending in `…` is cut there.
    shown = line.removesuffix("…")
    # A number near 0 may print with either sign.
    pattern = re.sub(r"(?:\\-)?\d+(?:\\\.\d+)?", r"-?\\d+(?:\\.\\d+)?", re.escape(shown))
    matches = re.match if shown != line else re.fullmatch
    assert any(matches(pattern, printed_line) for printed_line in printed), line


def test_on_a_base_install_the_demo_says_the_heatmap_picture_needs_the_plots_extra(demo_run):
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  assert any(requirement.startswith("matplotlib") for requirement in extras["plots"])
  assert (
    'heatmap picture not drawn: matplotlib is missing; pip install "flaxlens[plots]"'
    in demo_run.stdout.splitlines()
  )
  assert not list(Path(_files_folder(demo_run)).expanduser().glob("*.png"))


def test_on_a_base_install_the_demo_says_the_harvest_needs_the_harvest_extra(demo_run):
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  assert any(requirement.startswith("tensorstore") for requirement in extras["harvest"])
  assert (
    'harvest not run: TensorStore is missing; pip install "flaxlens[harvest]"'
    in demo_run.stdout.splitlines()
  )


def test_the_demo_marks_the_heads_whose_interval_excludes_zero(demo_run):
  (line,) = [x for x in demo_run.stdout.splitlines() if x.startswith("heads whose 95% bootstrap")]
  for low, high in re.findall(r"\[(-?[\d.]+), (-?[\d.]+)\]", line):
    assert 0 < float(low) <= float(high)


def test_with_tensorstore_the_demo_harvests_rows_equal_to_flax_capture_intermediates(tmp_path):
  pytest.importorskip("tensorstore")
  from rich.console import Console

  story = _demo._Story(Console(file=io.StringIO()), str(tmp_path), None)
  story.linen()
  story.research()
  assert story.proofs and all(story.proofs)
  assert story.console.file.getvalue().count("bit for bit: True") >= 4
  assert "the third batch's rows equal Flax's own capture_intermediates bit for bit: True" in (
    story.console.file.getvalue()
  )


def test_with_matplotlib_the_demo_draws_the_heatmap_and_says_where(tmp_path):
  pytest.importorskip("matplotlib")
  picture = tmp_path / "sweep.png"
  result = fl.SweepResult(np.array([[0.0, 1.0], [2.0, 3.0]]), ("a", "b"), (0, 1))
  assert _demo._plot(result, str(picture)) == f"heatmap: {picture}"
  assert picture.read_bytes().startswith(b"\x89PNG")


def test_the_demo_heatmap_legend_names_what_the_cells_measure(demo_run):
  legend = "logit of the clean answer after patching: ' ' = "
  assert any(line.strip().startswith(legend) for line in demo_run.stdout.splitlines())


def _files_folder(done: subprocess.CompletedProcess) -> str:
  return done.stdout.splitlines()[-1].rsplit("files: ", 1)[1]


def test_an_unknown_command_is_a_usage_error():
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["frobnicate"])
  assert exit_info.value.code == 2


FACTORIES = """
import flax.linen as nn, jax, jax.numpy as jnp
from flax import nnx

X = jax.random.normal(jax.random.key(1), (2, 4))


def linen(seed=0, nudge=0.0):
  model = nn.Dense(3)
  variables = model.init(jax.random.key(seed), X)
  variables["params"]["bias"] = variables["params"]["bias"] + nudge
  return model, variables, (X,)


def linen_close():
  return linen(nudge=1e-6)


def linen_other():
  return linen(seed=1)


def nnx_model():
  return nnx.Linear(4, 3, rngs=nnx.Rngs(0)), (X,)


def nnx_with_kwargs():
  class Keyword(nnx.Module):
    def __init__(self):
      self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    def __call__(self, *, x):
      return self.linear(x)

  return Keyword(), (), {"x": X}


def not_a_model():
  return 3


def raises():
  raise ValueError("boom in factory")


def exits():
  import sys

  sys.exit(0)


class Quitter(nnx.Module):
  def __init__(self):
    self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

  def __call__(self, x):
    import sys

    sys.exit(0)


def model_exits():
  return Quitter(), (X,)
"""


@pytest.fixture
def target(tmp_path):
  path = tmp_path / "factories.py"
  path.write_text(FACTORIES)
  return lambda name: f"{path}:{name}"


def test_check_of_a_model_against_itself_is_bitwise_and_exits_0(target, capsys):
  assert cli.main(["check", target("linen"), target("linen")]) == 0
  assert capsys.readouterr().out.splitlines()[-1].startswith("equivalent")


@pytest.mark.parametrize(
  "other, leaf, largest",
  [("linen_close", "params:bias", 1e-5), ("linen_other", "params:kernel", None)],
)
def test_check_of_models_that_differ_prints_the_differences_and_exits_1(
  target, capsys, other, leaf, largest
):
  assert cli.main(["check", target("linen"), target(other)]) == 1
  out = capsys.readouterr().out
  row = next(line for line in out.splitlines() if line.startswith(leaf))
  assert row.split()[1] == "NO"
  if largest is not None:
    assert 0 < float(row.split()[2]) < largest


def test_check_of_a_model_against_its_saved_export(target, tmp_path, capsys):
  import jax.numpy as jnp

  from flaxlens._target import made

  given = made(target("nnx_model"))
  tree = fl.unflaxify(given.model, *given.args)
  fl.save_exported(tree.export(), tmp_path / "same.safetensors", format="safetensors")
  tree.scope_data.parameters["bias"].value = jnp.ones(3)
  fl.save_exported(tree.export(), tmp_path / "edited", format="orbax")
  assert cli.main(["check", target("nnx_model"), str(tmp_path / "same.safetensors")]) == 0
  assert cli.main(["check", target("nnx_model"), str(tmp_path / "edited")]) == 1
  assert "Param:bias" in capsys.readouterr().out


@pytest.mark.parametrize(
  "first, message",
  [
    ("nowhere.py:f", "There is no file 'nowhere.py'"),
    ("linen", "is not a TARGET"),
    (":not_a_model", "not_a_model() returned a int, not a tuple. The factory takes"),
    (":raises", "raises() raised ValueError: boom in factory. Fix the factory"),
  ],
)
def test_check_of_a_bad_target_exits_2_with_the_fix(target, capsys, first, message):
  first = target(first[1:]) if first.startswith(":") else first
  assert cli.main(["check", first, first]) == 2
  err = capsys.readouterr().err
  assert err.startswith("flaxlens check: ") and err.count("\n") == 1
  assert message in err and (not first.endswith("raises") or first in err)


def test_check_reads_a_factory_returning_kwargs_as_inspect_does(target, tmp_path, capsys):
  from flaxlens._target import made

  given = made(target("nnx_with_kwargs"))
  tree = fl.unflaxify(given.model, **given.kwargs)
  bias = tree.select().at_path("linear").get().scope_data.parameters["bias"]
  bias.value = bias.value + 1.0
  fl.save_exported(tree.export(), tmp_path / "edited.safetensors", format="safetensors")
  restored = fl.load_exported(tmp_path / "edited.safetensors", like=given.model)
  np.testing.assert_array_equal(restored(**given.kwargs), given.model(**given.kwargs) + 1.0)
  assert cli.main(["check", target("nnx_with_kwargs"), target("nnx_with_kwargs")]) == 0
  assert capsys.readouterr().out.splitlines()[-1].startswith("equivalent")
  assert cli.main(["check", target("nnx_with_kwargs"), str(tmp_path / "edited.safetensors")]) == 1
  assert "Param:linear/bias" in capsys.readouterr().out


def test_check_of_a_missing_export_says_the_file_does_not_exist(target, tmp_path, capsys):
  missing = str(tmp_path / "missing export.safetensors")
  assert cli.main(["check", target("nnx_model"), missing]) == 2
  err = capsys.readouterr().err
  assert (
    f"{missing}: there is no such file or directory" in err and "TARGET" not in err.split(".")[0]
  )


@pytest.mark.parametrize("command", ["check", "inspect"])
@pytest.mark.parametrize(
  "name, said",
  [
    ("exits", "exits() raised SystemExit: 0 (the code called sys.exit())"),
    ("model_exits", "SystemExit: 0 (the code called sys.exit())"),
  ],
)
def test_a_target_calling_sys_exit_fails_with_status_2_naming_it(
  target, capsys, command, name, said
):
  argv = [command, target(name)] + ([target("nnx_model")] if command == "check" else [])
  assert cli.main(argv) == 2
  captured = capsys.readouterr()
  assert captured.err.startswith(f"flaxlens {command}: ") and captured.err.count("\n") == 1
  assert target(name) in captured.err and said in captured.err


def test_a_file_calling_sys_exit_on_import_fails_with_status_2(tmp_path, capsys):
  (tmp_path / "quits.py").write_text("import sys\nsys.exit(3)\n")
  for argv in (
    ["inspect", f"{tmp_path}/quits.py:f"],
    ["check", f"{tmp_path}/quits.py:f", "x.py:f"],
  ):
    assert cli.main(argv) == 2
    assert "raised SystemExit: 3 (the code called sys.exit())" in capsys.readouterr().err


def test_inspect_prints_a_linen_models_calls_in_the_order_flax_makes_them():
  model, variables, args, kwargs = _examples().linen_lm()
  calls = []

  def record(next_fun, call_args, call_kwargs, context):
    if context.method_name != "setup":
      calls.append(["/".join(context.module.path) or "<root>", context.method_name])
    return next_fun(*call_args, **call_kwargs)

  with nn.intercept_methods(record):
    model.apply(variables, *args, **kwargs)
  done = _run("inspect", f"{EXAMPLES}:linen_lm")
  assert done.returncode == 0, done.stderr
  rows = _table_rows(done.stdout)
  assert [cells[:3:2] for cells in rows] == calls
  head = next(cells for cells in rows if cells[0] == "head")
  assert head[1:5] == ["Dense", "__call__", "float32[2,6,16]", "float32[2,6,64]"]
  assert head[5] == f"{_size(variables['params']['head']):,}"


def test_inspect_json_parses_and_counts_an_nnx_models_parameters_and_state():
  model, (x,) = _examples().nnx_mlp()
  done = _run("inspect", "examples/inspect_targets.py:nnx_mlp", "--json")
  assert done.returncode == 0, done.stderr
  data = json.loads(done.stdout)
  assert data["framework"] == "NNX"
  rows = {row["path"]: row for row in data["rows"]}
  assert list(rows) == ["", "hidden", "norm", "out"]
  assert rows[""]["outputs"] == f"float32[{','.join(map(str, model(x).shape))}]"
  for path in ("hidden", "norm", "out"):
    module = getattr(model, path)
    assert rows[path]["params"] == _size(nnx.state(module, nnx.Param))
  assert rows["norm"]["state"] == _size(nnx.state(model.norm, nnx.BatchStat))
  assert data["total"]["params"] == _size(nnx.state(model, nnx.Param))


def test_inspect_depth_leaves_out_deeper_calls(capsys):
  assert cli.main(["inspect", f"{EXAMPLES}:linen_lm", "--depth", "1", "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)["rows"]
  assert {row["depth"] for row in rows} == {0, 1}
  assert "Block_0" in [row["path"] for row in rows]


def test_inspect_path_keeps_the_calls_matching_the_pattern(capsys):
  assert cli.main(["inspect", f"{EXAMPLES}:linen_lm", "--path", "Block_*/Dense_*", "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)["rows"]
  assert [row["path"] for row in rows] == [
    "Block_0/Dense_1",
    "Block_0/Dense_0",
    "Block_1/Dense_1",
    "Block_1/Dense_0",
  ]


def test_inspect_says_when_the_depth_not_the_pattern_left_out_the_calls(capsys):
  argv = ["inspect", f"{EXAMPLES}:linen_lm", "--depth", "1", "--path", "Block_*/Dense_*"]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert "'Block_*/Dense_*' matches 4 calls ('Block_0/Dense_1' among them)" in err
  assert "--depth 1 leaves out" in err and "Pass --depth 2 or more" in err
  assert "No call matches" not in err


def test_inspect_html_page_leaves_out_the_calls_depth_leaves_out(tmp_path, capsys):
  page = tmp_path / "view.html"
  argv = ["inspect", f"{EXAMPLES}:linen_lm", "--depth", "1", "--html", str(page)]
  assert cli.main(argv) == 0
  table = page.read_text(encoding="utf-8").split('<table class="flaxlens-summary">')[1]
  paths = [
    html.unescape(p) for p in re.findall(r"<tr><td>([^<]*)</td>", table.split("</table>")[0])
  ]
  assert "Block_0" in paths and "Block_0/Dense_0" not in paths
  assert paths == [*(cells[0] for cells in _table_rows(capsys.readouterr().out)), "total"]


def test_inspect_folds_the_table_to_the_terminals_width_losing_nothing(capsys, monkeypatch):
  assert cli.main(["inspect", f"{EXAMPLES}:linen_lm", "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)["rows"]
  monkeypatch.setenv("COLUMNS", "80")
  assert cli.main(["inspect", f"{EXAMPLES}:linen_lm"]) == 0
  out = capsys.readouterr().out
  assert max(len(line) for line in out.splitlines()) <= 80
  shown = [cells[:5] for cells in folded_rows(out)[1:-1]]
  fields = ("path", "module", "method", "inputs", "outputs")
  assert shown == [["".join((row[f] or "<root>").split()) for f in fields] for row in rows]


def test_inspect_folds_a_heading_longer_than_the_terminal(tmp_path, capsys, monkeypatch):
  folder = tmp_path / ("a_folder_whose_name_is_long_" * 3)
  folder.mkdir()
  target = folder / "inspect_targets.py"
  target.write_text(EXAMPLES.read_text())
  monkeypatch.setenv("COLUMNS", "80")
  assert cli.main(["inspect", f"{target}:linen_lm"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert max(len(line) for line in lines) <= 80
  heading = "".join(lines[: lines.index("")]).replace(" ", "")  # folded, nothing lost
  assert heading == f"{target}:linen_lm: Linen model, 27 calls".replace(" ", "")


def test_inspect_html_writes_the_web_page(tmp_path, capsys):
  page = tmp_path / "view.html"
  assert cli.main(["inspect", f"{EXAMPLES}:nnx_mlp", "--html", str(page)]) == 0
  assert f"wrote {page}" in capsys.readouterr().out
  assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_inspect_html_makes_the_missing_folders_of_the_page(tmp_path, capsys):
  page = tmp_path / "no such folder" / "deeper" / "page.html"
  assert cli.main(["inspect", f"{EXAMPLES}:nnx_mlp", "--html", str(page)]) == 0
  assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_inspect_html_to_a_path_it_cannot_write_exits_2_with_one_paragraph(tmp_path, capsys, where):
  (tmp_path / "file").write_text("")
  page = tmp_path if where == "a directory" else tmp_path / "file" / "page.html"
  assert cli.main(["inspect", f"{EXAMPLES}:nnx_mlp", "--html", str(page)]) == 2
  captured = capsys.readouterr()
  assert captured.out == "" and captured.err.count("\n") == 1
  fix = "is a directory. Give the path of the file" if where == "a directory" else "cannot write"
  assert captured.err.startswith("flaxlens inspect: ") and fix in captured.err


_BAD_FILES = {
  "raises_on_import.py": "raise RuntimeError('no GPU here')\n",
  "targets.py": """
    import flax.linen as nn, jax, jax.numpy as jnp
    from flax import nnx

    def not_a_tuple():
      return nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    def args_not_a_tuple():
      return nnx.Linear(2, 3, rngs=nnx.Rngs(0)), jnp.ones((1, 2))

    def linen_without_variables():
      return nn.Dense(3), (jnp.ones((1, 2)),)

    def wrong_input_shape():
      return nnx.Linear(2, 3, rngs=nnx.Rngs(0)), (jnp.ones((1, 5)),)

    def wrong_linen_variables():
      model = nn.Dense(3)
      return model, model.init(jax.random.key(0), jnp.ones((1, 2))), (jnp.ones((1, 5)),)

    def raises():
      raise ValueError('checkpoint not found')

    class Branchy(nnx.Module):
      def __call__(self, x):
        return x if float(x.sum()) > 0 else -x

    def value_branch():
      return Branchy(), (jnp.ones(2),)

    number = 3
  """,
}


@pytest.fixture
def bad_targets(tmp_path):
  for name, text in _BAD_FILES.items():
    (tmp_path / name).write_text(textwrap.dedent(text))
  return tmp_path


@pytest.mark.parametrize(
  "target, fix",
  [
    ("no_colon_here", "Write path/to/file.py:factory or package.module:factory"),
    ("missing.py:make", "There is no file 'missing.py'"),
    ("no_such_package_xyz.models:make", "with --import-path DIR, or install the package"),
    ("raises_on_import.py:make", "RuntimeError: no GPU here. Fix the file"),
    ("targets.py:absent", "(its functions: ['args_not_a_tuple', 'linen_without_variables', "),
    ("targets.py:number", "Name a function that takes no arguments"),
    ("targets.py:raises", "ValueError: checkpoint not found. Fix the factory"),
    ("targets.py:not_a_tuple", "returned a Linear, not a tuple"),
    ("targets.py:args_not_a_tuple", "args must be a tuple and kwargs a dict"),
    ("targets.py:linen_without_variables", "returned (Dense, tuple)"),
    ("targets.py:wrong_input_shape", "Return example inputs the model accepts"),
    ("targets.py:wrong_linen_variables", "what module.apply(variables, *args, **kwargs) takes"),
    ("targets.py:value_branch", "targets.py:value_branch: Branchy.__call__: this call uses"),
  ],
)
def test_a_bad_target_exits_2_with_one_paragraph_naming_the_fix(
  bad_targets, monkeypatch, capsys, target, fix
):
  monkeypatch.chdir(bad_targets)
  assert cli.main(["inspect", target]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  message = captured.err
  assert message.startswith("flaxlens inspect: ") and message.count("\n") == 1
  assert fix in message


def test_a_bad_target_shows_no_traceback_unless_debug(bad_targets):
  done = _run("inspect", "targets.py:wrong_input_shape", cwd=bad_targets)
  assert done.returncode == 2
  assert "Traceback" not in done.stderr and "flaxlens inspect:" in done.stderr
  debug = _run("inspect", "targets.py:wrong_input_shape", "--debug", cwd=bad_targets)
  assert debug.returncode != 0
  assert "Traceback" in debug.stderr
