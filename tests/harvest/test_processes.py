"""fl.harvest in a run of two processes (`jax.distributed`, coordinated on 127.0.0.1, two
CPU devices each), launched by the module fixture with a hard time limit: every process
feeds its own rows of each global batch, and together they write one store, equal row for
row to a single-process harvest of the same global batches and to Flax's own capture;
stopped midway, the same call resumes it."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import flaxlens as fl

from . import models
from . import processes_check as check

CHECK = pathlib.Path(check.__file__)
ROOT = CHECK.parents[2]
TIMEOUT = 300  # seconds for both processes together


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> pathlib.Path:
  """The two processes' output directory: a store per framework (and a resumed one), and
  each process's report."""
  out = tmp_path_factory.mktemp("processes")
  port = _free_port()
  path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
  env = {**os.environ, "PYTHONPATH": path}
  processes, logs = [], []
  try:
    for process in range(check.PROCESSES):
      logs.append(open(out / f"log-{process}.txt", "w"))  # noqa: SIM115 (closed in finally)
      processes.append(
        subprocess.Popen(
          [sys.executable, str(CHECK), str(port), str(process), str(out)],
          stdout=logs[-1],
          stderr=subprocess.STDOUT,
          env=env,
          cwd=CHECK.parent,
        )
      )
    deadline = time.monotonic() + TIMEOUT
    for process in processes:
      process.wait(timeout=max(1.0, deadline - time.monotonic()))
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
    for log in logs:
      log.close()
  failed = {
    n: (out / f"log-{n}.txt").read_text()[-3000:]
    for n, process in enumerate(processes)
    if process.returncode != 0
  }
  assert not failed, failed
  return out


def _report(run: pathlib.Path, process: int, framework: str) -> dict:
  return json.loads((run / f"report-{process}.json").read_text())[framework]


def _arrays(store: fl.Harvest) -> dict[str, np.ndarray]:
  found = {}
  for site in store.sites:
    rows = store[site]
    found[f"{site} values"] = rows[:].view(np.uint8)
    found[f"{site} index"] = rows.index[:]
    found[f"{site} ids"] = rows.ids[:]
  return found


def _assert_same_rows(got: fl.Harvest, expected: fl.Harvest) -> None:
  assert got.complete and expected.complete
  assert (len(got), got.batches_committed) == (len(expected), expected.batches_committed)
  got, expected = _arrays(got), _arrays(expected)
  assert got.keys() == expected.keys()
  for name in expected:
    assert got[name].shape == expected[name].shape, name
    assert np.array_equal(got[name], expected[name]), name


def test_two_processes_write_one_store_equal_to_a_single_process_harvest(run, model, tmp_path):
  single = check.harvest(model, check.global_batches(), str(tmp_path / "one"))
  both = fl.open_harvest(run / model.framework)
  assert both.metadata["fingerprint"] == single.metadata["fingerprint"]
  _assert_same_rows(both, single)


def test_two_processes_store_the_rows_of_flaxs_own_capture(run, model):
  both = fl.open_harvest(run / model.framework)
  batches = check.global_batches()
  native = [model.native(tokens) for tokens in batches]
  every = np.concatenate([np.asarray(n[model.sites[0]]).reshape(-1, models.WIDTH) for n in native])
  kept = np.concatenate(
    [
      np.asarray(n[model.sites[1]])[models.not_padding(tokens)]
      for n, tokens in zip(native, batches, strict=True)
    ]
  )
  assert np.array_equal(both[model.sites[0]][:].view(np.uint8), every.view(np.uint8))
  assert np.array_equal(both[model.sites[1]][:].view(np.uint8), kept.view(np.uint8))


def test_each_process_writes_only_the_rows_of_its_own_examples(run, model):
  both = fl.open_harvest(run / model.framework)
  share = check.SIZE // check.PROCESSES
  written = 0
  for process in range(check.PROCESSES):
    examples = _report(run, process, model.framework)["examples written"]
    assert set(examples) == set(range(process * share, (process + 1) * share))
    written += len(examples)
  assert written == sum(len(both[site]) for site in both.sites)  # each row once


def test_a_two_process_harvest_stopped_midway_resumes_where_it_stopped(run, model):
  committed = [_report(run, p, model.framework)["committed when stopped"] for p in (0, 1)]
  assert committed[0] == committed[1] and 0 < committed[0] < check.STOP
  resumed = fl.open_harvest(run / f"{model.framework}-resumed")
  _assert_same_rows(resumed, fl.open_harvest(run / model.framework))


def _refusal(run: pathlib.Path, case: str) -> list[str]:
  return [
    json.loads((run / f"report-{p}.json").read_text())["refused"][case]
    for p in range(check.PROCESSES)
  ]


def test_host_batches_without_sharding_are_refused_on_every_process(run):
  for message in _refusal(run, "host batches"):
    assert message.startswith("ArgumentError: fl.harvest: batch 0 holds arrays of this process")
    assert message.endswith("or give global jax.Arrays.")


def test_variables_held_by_one_process_are_refused_on_every_process(run):
  for message in _refusal(run, "variables of one process"):
    assert message.startswith("ArgumentError: fl.harvest: the variables ['params:Embed_0/")
    assert "Place the model's variables on the global mesh" in message
