"""The one walk over what a function reads (`function_reads`), and the text of a function
that is the same in every process (`StableText`, what a harvest store records of a mask
or an `ids=` function)."""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
import pytest

from flaxlens.core._functions import StableText, function_reads

OFFSET = 7


def _scaled(scale):
  def fn(x, shift=1, *, power=2, base=0):
    return (x * scale + shift + OFFSET) ** power + base

  return fn


def test_function_reads_names_the_closure_the_defaults_and_the_globals_read():
  reads = function_reads(_scaled(3))
  assert reads.closure == (("scale", 3),)
  assert reads.defaults == (("shift", 1),)
  assert reads.keyword_defaults == (("base", 0), ("power", 2))  # sorted by name
  assert reads.globals == (("OFFSET", 7),)


def test_function_reads_refuses_a_variable_not_assigned_yet():
  def outer():
    fn = lambda: later  # noqa: E731
    with pytest.raises(ValueError):
      function_reads(fn)
    later = 1
    return later

  outer()


_TEXT = StableText(lambda array: f"array{array.shape}:{array.sum()}")


def test_the_text_of_a_function_follows_its_code_and_the_values_it_reads():
  assert _TEXT.function(_scaled(3)) == _TEXT.function(_scaled(3))  # new object, same values
  assert _TEXT.function(_scaled(3)) != _TEXT.function(_scaled(4))
  assert _TEXT.function(_scaled(np.ones(2))) != _TEXT.function(_scaled(np.ones(3)))
  half = functools.partial(_scaled(3), shift=2)
  assert _TEXT.function(half).startswith("partial(_scaled.<locals>.fn:")
  assert _TEXT.values([1, "a", None, (2.5, [True])]) == "1,'a',None,[2.5,[True]]"


def test_the_text_of_a_function_is_the_same_in_another_process():
  script = (
    "from tests.core.test_functions import _TEXT, _scaled;"
    " print(_TEXT.function(_scaled(3)), end='')"
  )
  other = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, check=True
  ).stdout
  assert other == _TEXT.function(_scaled(3))
