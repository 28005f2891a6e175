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
