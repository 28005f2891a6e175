"""The command line."""

from __future__ import annotations

import pytest

from flaxlens import cli


def test_demo_converts_checks_and_reports_an_exact_match(capsys):
  assert cli.main(["demo"]) == 0
  out = capsys.readouterr().out
  assert "bit for bit: True" in out
  assert "Block_1/MultiHeadDotProductAttention_0" in out


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
  return nnx.Linear(4, 3, rngs=nnx.Rngs(0)), X


def not_a_model():
  return 3
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

  import flaxlens as fl

  model, x = cli._load_target(target("nnx_model"))
  tree = fl.unflaxify(model, *x)
  fl.save_exported(tree.export(), tmp_path / "same.safetensors", format="safetensors")
  tree.scope_data.parameters["bias"].value = jnp.ones(3)
  fl.save_exported(tree.export(), tmp_path / "edited", format="orbax")
  assert cli.main(["check", target("nnx_model"), str(tmp_path / "same.safetensors")]) == 0
  assert cli.main(["check", target("nnx_model"), str(tmp_path / "edited")]) == 1
  assert "Param:bias" in capsys.readouterr().out


@pytest.mark.parametrize(
  "first, message",
  [
    ("nowhere.py:f", "no such Python file"),
    ("linen", "is not a TARGET"),
    (":not_a_model", "must return (nnx_model, inputs)"),
  ],
)
def test_check_of_a_bad_target_exits_2_with_the_fix(target, capsys, first, message):
  first = target("not_a_model") if first == ":not_a_model" else first
  assert cli.main(["check", first, first]) == 2
  assert message in capsys.readouterr().err
