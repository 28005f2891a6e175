"""Attribution graphs of a model sharded across a device mesh (four CPU devices, in a
subprocess: `sharded_check.py`)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

CHECK = pathlib.Path(__file__).with_name("sharded_check.py")


def test_the_graph_of_a_sharded_model_equals_the_references():
  result = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  report = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
  assert report["parameters sharded"] == "True"
  assert report["graph equal"] == "True", report["graph max diff"]
