"""One of the two processes of a `jax.distributed` harvest, run by test_processes.py.

`python processes_check.py PORT PROCESS OUT`: joins a run of two processes coordinated at
127.0.0.1:PORT, each with two CPU devices; for each Flax API, both processes feed their
own rows of every global batch (`sharding=`) and harvest into one store, `OUT/FRAMEWORK`,
then into `OUT/FRAMEWORK-resumed` a stream that stops after `STOP` batches, and the same
call again, which resumes; then two calls that are refused. Writes
`OUT/report-PROCESS.json`: per framework, the batches committed when the stream stopped
and the examples (within their batch) of the rows this process wrote in the straight
harvest; the refusals' messages.
"""

from __future__ import annotations

import json
import os
import sys

try:
  from . import models
except ImportError:  # run as a script
  import models

BATCHES, SIZE, STOP = 5, 4, 4  # global batches of SIZE examples; the stopped stream's length
PROCESSES, DEVICES = 2, 2  # processes, CPU devices per process
FRAMEWORKS = ("linen", "nnx")


def global_batches() -> list:
  """The global batches: process `p` feeds examples `p * SIZE // PROCESSES` onwards."""
  return models.token_batches(BATCHES, size=SIZE, seed=1)


def harvest(model, batches, path: str, **options):
  """The harvest call every run of this test makes (the single-process one included)."""
  import flaxlens as fl

  return fl.harvest(
    model.tree,
    batches,
    model.sites,
    path,
    positions={model.sites[0]: "all", "**": models.not_padding},
    ids=models.token_ids,
    progress=False,
    **options,
  )


def refusal(call) -> str:
  """`ErrorType: message` of what `call` raised."""
  try:
    call()
  except Exception as error:
    return f"{type(error).__name__}: {error}"
  return "nothing raised"


class Stopped(Exception):
  """The stopped stream's end."""


def main() -> None:
  """Imports JAX only here, so that importing this file (from the test) is inert."""
  port, process, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    coordinator_bind_address=f"127.0.0.1:{port}",
    num_processes=PROCESSES,
    process_id=process,
    initialization_timeout=120,
  )
  from flaxlens.tools.harvest import _writing

  mesh = Mesh(np.array(jax.devices()), ("data",))
  replicated, rows = (
    NamedSharding(mesh, PartitionSpec()),
    NamedSharding(mesh, PartitionSpec("data")),
  )
  share = SIZE // PROCESSES
  local = [b[process * share : (process + 1) * share] for b in global_batches()]

  def stopping():
    for number, batch in enumerate(local):
      if number == STOP:
        raise Stopped
      yield batch

  written: list[int] = []
  original = _writing.pieces

  def recorded(array, counts):
    """The examples (within their batch) of the rows of the pieces this process writes."""
    found = original(array, counts)
    for first, _, data in found:
      if counts is not None and data.dtype.kind == "i" and data.shape[1:] == (2,):
        written.extend(int(example) for example in data[:, 0])  # a mask's rows' index
      elif counts is None and data.dtype.kind == "f":  # positions="all": rows of LENGTH
        written.extend(row // models.LENGTH for row in range(first, first + len(data)))
    return found

  report = {}
  for framework in FRAMEWORKS:
    model = models.build(framework, place=lambda v: jax.device_put(v, replicated))
    written.clear()
    _writing.pieces = recorded
    try:
      harvest(model, local, f"{out}/{framework}", sharding=rows)
    finally:
      _writing.pieces = original
    try:
      harvest(model, stopping(), f"{out}/{framework}-resumed", sharding=rows)
    except Stopped:
      pass
    import flaxlens as fl

    committed = fl.open_harvest(f"{out}/{framework}-resumed").batches_committed
    harvest(model, local, f"{out}/{framework}-resumed", sharding=rows)
    report[framework] = {"committed when stopped": committed, "examples written": written[:]}
  report["refused"] = {
    "host batches": refusal(
      lambda: harvest(model, local, f"{out}/refused")  # this process's rows, no sharding=
    ),
    "variables of one process": refusal(
      lambda: harvest(models.build("linen"), local, f"{out}/refused", sharding=rows)
    ),
  }
  with open(f"{out}/report-{process}.json", "w") as file:
    json.dump(report, file)


if __name__ == "__main__":
  main()
