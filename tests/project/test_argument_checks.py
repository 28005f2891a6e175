"""Public functions refuse arguments of the wrong kind with an `ArgumentError` that names
the function, the argument and what to pass, instead of a bare `TypeError` from deep
inside (a path given as None, a tree that is not one, one intervention not in a list)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import flaxlens as fl

X = jnp.ones((1, 3))
MODEL = nn.Dense(2)
VARIABLES = MODEL.init(jax.random.key(0), X)


@pytest.fixture(scope="module")
def tree():
  return fl.unflaxify(MODEL, VARIABLES, X)


@pytest.fixture(scope="module")
def isolated():
  return fl.isolate(fl.unflaxify(MODEL, VARIABLES, X), X, "")


# (function, argument named in the message, the call with one wrong argument)
CASES = [
  ("fl.load_interventions", "path", lambda tree, iso, tmp: fl.load_interventions(None)),
  ("fl.load_interventions", "allow", lambda tree, iso, tmp: fl.load_interventions(tmp, allow=3)),
  (
    "fl.save_interventions",
    "path",
    lambda tree, iso, tmp: fl.save_interventions([fl.ablate("")], None),
  ),
  (
    "fl.save_interventions",
    "interventions",
    lambda tree, iso, tmp: fl.save_interventions(None, tmp / "set"),
  ),
  ("fl.summary", "tree", lambda tree, iso, tmp: fl.summary(None)),
  ("fl.summary", "max_depth", lambda tree, iso, tmp: fl.summary(tree, "2")),
  ("fl.summary", "path", lambda tree, iso, tmp: fl.summary(tree, path=3)),
  ("fl.summary", "argument", lambda tree, iso, tmp: fl.summary(tree, argument=X)),
  ("fl.to_html", "tree", lambda tree, iso, tmp: fl.to_html(None)),
  ("fl.to_html", "path", lambda tree, iso, tmp: fl.to_html(tree, 3)),
  ("fl.save_exported", "exported", lambda tree, iso, tmp: fl.save_exported(None, tmp / "e")),
  ("fl.save_exported", "path", lambda tree, iso, tmp: fl.save_exported(VARIABLES, None)),
  (
    "fl.save_exported",
    "format",
    lambda tree, iso, tmp: fl.save_exported(VARIABLES, tmp / "e", format=None),
  ),
  ("fl.load_exported", "path", lambda tree, iso, tmp: fl.load_exported(None, like=VARIABLES)),
  ("fl.load_exported", "like", lambda tree, iso, tmp: fl.load_exported(tmp, like=None)),
  ("fl.save_isolated", "isolated", lambda tree, iso, tmp: fl.save_isolated(None, tmp / "i")),
  ("fl.save_isolated", "path", lambda tree, iso, tmp: fl.save_isolated(iso, None)),
  (
    "fl.save_isolated",
    "overwrite",
    lambda tree, iso, tmp: fl.save_isolated(iso, tmp / "i", overwrite="yes"),
  ),
  ("fl.load_isolated", "path", lambda tree, iso, tmp: fl.load_isolated(None)),
  ("fl.load_isolated", "max_bytes", lambda tree, iso, tmp: fl.load_isolated(tmp, max_bytes=None)),
  ("fl.isolate", "at", lambda tree, iso, tmp: fl.isolate(tree, X, None)),
  ("fl.isolate", "tree", lambda tree, iso, tmp: fl.isolate(MODEL, X, "")),
  ("fl.isolate", "every", lambda tree, iso, tmp: fl.isolate(tree, X, "", every="yes")),
]


@pytest.mark.parametrize(
  "function, argument, call", CASES, ids=[f"{f}-{a}-{i}" for i, (f, a, _) in enumerate(CASES)]
)
def test_an_argument_of_the_wrong_kind_is_an_argument_error_naming_it(
  tree, isolated, tmp_path, function, argument, call
):
  with pytest.raises(fl.ArgumentError) as refused:
    call(tree, isolated, tmp_path)
  message = str(refused.value)
  assert message.startswith(f"{function}: {argument} must be"), message
  assert message.endswith("."), message


def test_an_argument_error_is_also_the_type_error_python_would_raise():
  with pytest.raises(TypeError):
    fl.load_isolated(None)


@pytest.mark.parametrize("variables", [{}, {"params": {}}], ids=["no_collection", "no_param"])
def test_linen_variables_missing_what_the_model_reads_are_an_argument_error(variables):
  with pytest.raises(Exception) as native:
    MODEL.apply(variables, X)
  with pytest.raises(fl.ArgumentError, match=r"unflaxify\(Dense\): variables lacks") as ours:
    fl.unflaxify(MODEL, variables, X)
  assert type(ours.value.__cause__) is type(native.value)
  assert str(ours.value.__cause__) == str(native.value)
