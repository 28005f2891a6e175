"""Every script in examples/ runs to completion, as a user would run it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Scripts on third-party models or checkpoints need their package (the `models` or `export`
# extra).
NEEDS = {"hf_gpt2.py": "transformers", "your_model.py": "orbax.checkpoint"}
# Scripts whose full run is a slow test of its own: CI runs their quick path.
ARGS = {"induction_heads.py": ["--quick"]}  # the full run: tests/zoo/test_induction_heads.py
SCRIPTS = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def _marks(script: str) -> list:
  return [pytest.mark.slow] if script in NEEDS else []


@pytest.mark.parametrize(
  "script", [pytest.param(s, marks=_marks(s), id=s.removesuffix(".py")) for s in SCRIPTS]
)
def test_example_runs(script):
  if script in NEEDS:
    pytest.importorskip(NEEDS[script])
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  done = subprocess.run(
    [sys.executable, str(ROOT / "examples" / script), *ARGS.get(script, [])],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode == 0, done.stderr[-4000:]
